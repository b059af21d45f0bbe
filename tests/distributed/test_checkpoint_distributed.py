"""CheckpointManager on two real gloo ranks: resharding across world sizes, async saves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.fsdp import fully_shard

from kempnerforge.checkpoint.manager import CheckpointError, CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from tests.support.dist import run_distributed
from tests.unit.test_checkpoint import _build, _load, _save, _train
from tests.unit.test_checkpoint_async import _disk_full_write, _names


def _sharded(seed: int):
    """_build's model, FSDP-sharded, with its optimizer and scheduler built after."""
    model, _, _ = _build(seed=seed)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.full_tensor() for name, p in model.named_parameters()}


def _grow_then_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Resume the world-size-1 checkpoint in ws1 on two ranks, train, save into ws2."""
    cfg = CheckpointConfig(resume_from=str(Path(root) / "ws1" / "step_3"))
    grown = CheckpointManager(cfg, str(Path(root) / "ws1"), rank=rank, world_size=world_size)
    model, optimizer, scheduler = _sharded(seed=7)
    path = grown.find_resume_path()
    state = grown.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
    loaded = _full_params(model)
    _train(model, optimizer, scheduler, range(3, 5))
    manager = CheckpointManager(
        CheckpointConfig(), str(Path(root) / "ws2"), rank=rank, world_size=world_size
    )
    manager.save(
        5,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_state={"who": rank, "tokens_seen": 50},
    )
    return {
        "who": state["who"],
        "step": state["step"],
        "loaded": loaded,
        "saved": _full_params(model),
    }


@pytest.mark.distributed
def test_a_checkpoint_loads_at_another_world_size(tmp_path, log):
    manager = CheckpointManager(CheckpointConfig(), str(tmp_path / "ws1"))
    parts = _build()
    _train(*parts, range(3))
    saved = {name: p.detach().clone() for name, p in parts[0].named_parameters()}
    _save(manager, 3, parts, who=0)

    ranks = run_distributed(_grow_then_save, 2, str(tmp_path))
    # Rank 1 did not exist in the saving run: it gets rank 0's train state.
    assert [(r["who"], r["step"]) for r in ranks] == [(0, 3), (0, 3)]
    for result in ranks:
        for name, value in saved.items():
            assert torch.equal(result["loaded"][name], value), name

    # Back to one process: the sharded world-size-2 checkpoint reshards into a plain model.
    shrunk = CheckpointManager(CheckpointConfig(), str(tmp_path / "ws2"))
    fresh = _build(seed=3)
    state = _load(shrunk, shrunk.find_resume_path(), fresh)
    assert state["who"] == 0 and state["step"] == 5
    for name, param in fresh[0].named_parameters():
        assert torch.equal(param, ranks[0]["saved"][name]), name
    assert len(fresh[1].state) == 4 and "saved by 2 ranks and this run has 1" in log.text


def _async_saves(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Async saves every other step with FSDP training in between, then a save whose
    write fails on rank 1 only; return the parameters and what each rank raised."""
    model, optimizer, scheduler = _sharded(seed=0)
    cfg = CheckpointConfig(async_mode="async", keep_last_n=1)
    manager = CheckpointManager(cfg, root, rank=rank, world_size=world_size)
    for step in range(1, 7):
        # FSDP collectives on the default group while DCP writes on its own group.
        _train(model, optimizer, scheduler, range(step - 1, step))
        manager.poll()
        if step % 2 == 0:
            manager.save(
                step,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                train_state={"tokens_seen": step},
            )
    full = _full_params(model)
    manager.wait()
    if rank == 1:  # this process only: the disk fills up under one rank
        FileSystemWriter.write_data = _disk_full_write  # type: ignore[method-assign]
    state = {"tokens_seen": 8}
    manager.save(8, model=model, optimizer=optimizer, scheduler=scheduler, train_state=state)
    try:
        manager.wait()  # every rank raises, none hangs
    except CheckpointError as e:
        return {"params": full, "error": str(e)}
    return {"params": full, "error": None}


@pytest.mark.distributed
def test_async_saves_at_world_size_two_commit_load_and_agree_on_failure(tmp_path):
    root = tmp_path / "ckpt"
    ranks = run_distributed(_async_saves, 2, str(root))
    tmp = root / "step_8.tmp"
    errors = [r["error"] for r in ranks]
    free = errors[0].split("the disk is full: ")[1].split()[0]
    expected = (
        f"{root}: the background write of checkpoint step_8 into {tmp} failed, so it was "
        f"not committed (the disk is full: {free} bytes free on the file system of {root} "
        "(rank 1: OSError: [Errno 28] No space left on device)); 'latest' still names step_6"
    )
    assert errors == [expected, expected]  # the same report on every rank
    assert _names(CheckpointManager(CheckpointConfig(), str(root))) == ["latest", "step_6"]
    manager = CheckpointManager(CheckpointConfig(), str(root))
    fresh = _build(seed=3)
    assert _load(manager, manager.find_resume_path(), fresh)["step"] == 6
    for name, param in fresh[0].named_parameters():
        assert torch.equal(param, ranks[0]["params"][name]), name
