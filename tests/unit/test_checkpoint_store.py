"""Checkpoints in a store, on fsspec's memory store: the marker makes a checkpoint, readers
never take a prefix without one, interrupted saves are cleared, retention deletes only
checkpoints this run saw complete, and a rank fetches only its own share."""

from __future__ import annotations

import logging

import fsspec
import pytest
import torch
from torch import nn

from kempnerforge.checkpoint.manager import CheckpointError, CheckpointManager
from kempnerforge.checkpoint.store import CheckpointStore
from kempnerforge.checkpoint.store_reads import split_store_url
from kempnerforge.config.checkpoint import CheckpointConfig


@pytest.fixture
def store_url(memory_root):
    return memory_root


def _manager(url: str, tmp_path, **cfg) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(**cfg), url, staging_dir=str(tmp_path / "staging"))


def _parts(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    return model, optimizer, scheduler


def _save(manager: CheckpointManager, step: int, seed: int = 0) -> None:
    model, optimizer, scheduler = _parts(seed)
    manager.save(
        step, model=model, optimizer=optimizer, scheduler=scheduler, train_state={"tokens": step}
    )


def _objects(url: str) -> set[str]:
    fs = fsspec.filesystem("memory")
    root = fs._strip_protocol(url)
    return {p.removeprefix(root + "/") for p in fs.find(root)}


def test_a_save_uploads_every_file_then_the_marker_and_latest(store_url, tmp_path):
    manager = _manager(store_url, tmp_path)
    _save(manager, 3)
    stored = _objects(store_url)
    assert {"latest", "step_3/complete.json", "step_3/.metadata"} <= stored
    assert {"step_3/train_state_rank0.pt", "step_3/checksums_rank0.json"} <= stored
    assert not (tmp_path / "staging" / "step_3.tmp").exists()  # the staged copy is freed
    assert CheckpointStore(store_url, timeout_s=5, connections=2).read_latest() == "step_3"


def test_a_prefix_without_its_marker_is_never_taken(store_url, tmp_path):
    manager = _manager(store_url, tmp_path)
    _save(manager, 3, seed=1)
    _save(manager, 6, seed=2)
    fs = fsspec.filesystem("memory")
    fs.rm_file(f"{store_url}/step_6/complete.json")  # as if the save died before its marker
    fs.pipe_file(f"{store_url}/latest", b"step_6\n")  # and 'latest' named it all the same
    warnings: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = warnings.append  # type: ignore[method-assign]
    logging.getLogger("kempnerforge.checkpoint").addHandler(handler)
    try:
        resumed = _manager(store_url, tmp_path / "again")
        path = resumed.find_resume_path()
    finally:
        logging.getLogger("kempnerforge.checkpoint").removeHandler(handler)
    assert path == str(tmp_path / "again" / "staging" / "step_3")
    said = [r.getMessage() for r in warnings]
    assert any(f"'latest' names {store_url}/step_6, which has no complete.json" in m for m in said)
    model, optimizer, scheduler = _parts(seed=9)
    state = resumed.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert state["step"] == 3
    assert torch.equal(model.weight, _parts(seed=1)[0].weight)


def test_only_unmarked_prefixes_means_a_fresh_start(store_url, tmp_path):
    fsspec.filesystem("memory").pipe_file(f"{store_url}/step_5/__0_0.distcp", b"partial")
    assert _manager(store_url, tmp_path).find_resume_path() is None


def test_the_first_save_removes_what_interrupted_saves_left(store_url, tmp_path):
    fsspec.filesystem("memory").pipe_file(f"{store_url}/step_9/__0_0.distcp", b"partial")
    manager = _manager(store_url, tmp_path)
    _save(manager, 3)
    stored = _objects(store_url)
    assert not any(name.startswith("step_9/") for name in stored)
    assert "step_3/complete.json" in stored


def test_retention_deletes_only_the_checkpoints_this_run_wrote(store_url, tmp_path):
    _save(_manager(store_url, tmp_path / "earlier"), 1)  # another run's, never verified here
    manager = _manager(store_url, tmp_path, keep_last_n=1)
    for step in (2, 4, 6):
        _save(manager, step)
    prefixes = {name.split("/")[0] for name in _objects(store_url)}
    assert prefixes == {"latest", "step_1", "step_6"}


def test_saving_again_the_step_latest_names_is_refused(store_url, tmp_path):
    manager = _manager(store_url, tmp_path)
    _save(manager, 3)
    with pytest.raises(CheckpointError, match="'latest' names this checkpoint"):
        _save(manager, 3)
    assert "step_3/complete.json" in _objects(store_url)


def test_a_rank_fetches_only_its_own_share(store_url, tmp_path):
    manager = _manager(store_url, tmp_path)
    _save(manager, 3)
    fsspec.filesystem("memory").pipe_file(f"{store_url}/step_3/unrelated.bin", b"x" * 10)
    resumed = _manager(store_url, tmp_path / "again")
    path = resumed.find_resume_path()
    assert path is not None
    fetched = {p.name for p in (tmp_path / "again" / "staging" / "step_3").iterdir()}
    assert "unrelated.bin" not in fetched
    assert {"complete.json", ".metadata", "train_state_rank0.pt"} <= fetched


def test_a_save_after_latest_named_an_unmarked_prefix_goes_through(store_url, tmp_path):
    manager = _manager(store_url, tmp_path)
    _save(manager, 3, seed=1)
    _save(manager, 6, seed=2)
    fs = fsspec.filesystem("memory")
    fs.rm_file(f"{store_url}/step_6/complete.json")  # step_6's save died after 'latest' moved
    resumed = _manager(store_url, tmp_path / "again")
    path = resumed.find_resume_path()
    assert path == str(tmp_path / "again" / "staging" / "step_3")
    model, optimizer, scheduler = _parts(seed=9)
    resumed.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
    # Retraining to step 6 saves it again: the unmarked step_6 is no checkpoint to protect.
    _save(resumed, 6, seed=3)
    stored = _objects(store_url)
    assert "step_6/complete.json" in stored
    assert fs.cat_file(f"{store_url}/latest").decode().strip() == "step_6"
    again = _manager(store_url, tmp_path / "third")
    assert again.find_resume_path() == str(tmp_path / "third" / "staging" / "step_6")


@pytest.mark.parametrize(
    ("url", "split"),
    [
        ("s3://b/runs/x/ckpt/step_30", ("s3://b/runs/x/ckpt", "step_30")),
        ("s3://b/runs/x/ckpt/step_30/", ("s3://b/runs/x/ckpt", "step_30")),
        ("s3://b/runs/x/ckpt/latest", ("s3://b/runs/x/ckpt", None)),
        ("s3://b/runs/x/ckpt", ("s3://b/runs/x/ckpt", None)),
        ("s3://b", ("s3://b", None)),
        ("s3://step_3", ("s3://step_3", None)),  # a bucket named like a checkpoint
        ("s3://b/step_3", ("s3://b", "step_3")),
    ],
)
def test_a_store_url_names_a_checkpoints_prefix_and_the_checkpoint_in_it(url, split):
    assert split_store_url(url) == split
