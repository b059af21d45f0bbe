"""A planted checkpoint never runs code: every file a load reads refuses pickled callables.

Each test plants a payload whose unpickling would create a sentinel file, in one place a
loader reads, and checks the load fails naming the checkpoint while the sentinel never
appears. The DCP cases first show the planted item is live under DCP's default planner,
so they cannot pass for want of a working payload.
"""

from __future__ import annotations

import contextlib
import pathlib
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict

from kempnerforge.checkpoint.manager import CheckpointError, CheckpointManager
from tests.support.checksums import rerecord_checksums
from tests.unit.test_checkpoint import _build, _load, _manager, _save, _train

REFUSED = "is refused by a weights-only load (Unsupported global: GLOBAL getattr)"
TAMPERED = "not loading it (a tampered or foreign checkpoint?)"


class _Payload:
    """Unpickling this creates `sentinel`: what a planted checkpoint file would run."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (pathlib.Path.touch, (self.sentinel,))


def _resave_dcp(state_dict: dict, path: Path) -> None:
    """Replace the DCP files of checkpoint `path` with `state_dict`, as plain DCP saves it
    (with forged checksums)."""
    for file in [*path.glob("*.distcp"), path / ".metadata"]:
        file.unlink()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*assuming the intent is to save.*")
        dcp.save(state_dict, checkpoint_id=str(path), no_dist=True)
    rerecord_checksums(path)


def _planted(tmp_path: Path, where: str) -> tuple[CheckpointManager, Path, Path]:
    """A checkpoint saved by the manager whose DCP files are then re-saved with a payload
    at `where` ('optimizer': a param_groups entry; 'model': a model tensor key), the
    marker and the train state kept; with its manager and the payload's sentinel."""
    manager = _manager(tmp_path)
    parts = _build()
    _train(*parts, range(2))
    path = Path(_save(manager, 2, parts))
    sentinel = tmp_path / "pwned"
    model_sd, optim_sd = get_state_dict(parts[0], parts[1])
    if where == "optimizer":
        optim_sd["param_groups"][0]["lr"] = _Payload(sentinel)
    else:
        model_sd["0.weight"] = _Payload(sentinel)
    _resave_dcp({"model": model_sd, "optimizer": optim_sd}, path)
    return manager, path, sentinel


def _assert_live_under_the_default_planner(path: Path, sentinel: Path) -> None:
    """Load `path` as plain DCP would: the payload runs (then the sentinel is removed)."""
    model, optimizer, _ = _build(seed=5)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # What the payload leaves in the state may not fit it; only its side effect matters.
    with contextlib.suppress(Exception, CheckpointException), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(
            {"model": model_sd, "optimizer": optim_sd},
            checkpoint_id=str(path),
            planner=DefaultLoadPlanner(),
            no_dist=True,
        )
    assert sentinel.exists()
    sentinel.unlink()


def test_a_pickled_optimizer_item_never_runs_on_resume(tmp_path):
    manager, path, sentinel = _planted(tmp_path, "optimizer")
    _assert_live_under_the_default_planner(path, sentinel)
    assert manager.is_complete(path)  # the marker, metadata and layout are all in order
    with pytest.raises(CheckpointError) as error:
        _load(manager, str(path))
    assert (
        str(error.value) == f"{path}: DCP item 'optimizer.param_groups.0.lr' {REFUSED}; {TAMPERED}"
    )
    assert error.value.path == str(path)
    assert not sentinel.exists()


@pytest.mark.parametrize("loader", ["load_weights", "load"])
def test_a_pickled_object_under_a_tensor_key_never_runs(tmp_path, loader):
    manager, path, sentinel = _planted(tmp_path, "model")
    _assert_live_under_the_default_planner(path, sentinel)
    assert manager.is_complete(path)
    with pytest.raises(CheckpointError) as error:
        if loader == "load_weights":
            manager.load_weights(str(path), model=_build(seed=4)[0])
        else:
            _load(manager, str(path))
    assert str(error.value) == (
        f"{path}: DCP item 'model.0.weight' must be a tensor but was saved as a pickled "
        f"object; {TAMPERED}"
    )
    assert not sentinel.exists()


def test_a_plain_value_under_a_tensor_key_is_refused_too(tmp_path):
    manager = _manager(tmp_path)
    parts = _build()
    path = Path(_save(manager, 2, parts))
    model_sd, optim_sd = get_state_dict(parts[0], parts[1])
    model_sd["0.weight"] = 3  # loads weights-only, but is no tensor
    _resave_dcp({"model": model_sd, "optimizer": optim_sd}, path)
    model = _build(seed=4)[0]
    before = model[0].weight.detach().clone()
    with pytest.raises(CheckpointError, match="'model.0.weight' must be a tensor"):
        manager.load_weights(str(path), model=model)
    assert torch.equal(model[0].weight, before)


@pytest.mark.parametrize("reader", ["load", "read_extra"])
def test_the_train_state_is_loaded_weights_only(tmp_path, reader):
    manager = _manager(tmp_path)
    path = Path(_save(manager, 3))
    sentinel = tmp_path / "pwned"
    file = path / "train_state_rank0.pt"
    torch.save({"step": 3, "evil": _Payload(sentinel)}, file)
    rerecord_checksums(path)
    torch.load(file, weights_only=False)  # the payload is live ...
    assert sentinel.exists()
    sentinel.unlink()
    with pytest.raises(CheckpointError) as error:  # ... but never runs here
        if reader == "load":
            _load(manager, str(path))
        else:
            manager.read_extra(str(path))
    assert str(error.value) == (
        f"{file}: cannot be read as a weights-only torch file (Unsupported global: GLOBAL getattr)"
    )
    assert not sentinel.exists()


@pytest.mark.parametrize("loader", ["load", "load_weights"])
def test_dcp_metadata_is_unpickled_through_an_allow_list(tmp_path, loader):
    manager = _manager(tmp_path)
    path = Path(_save(manager, 3))
    sentinel = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(sentinel)))
    pickle.loads((path / ".metadata").read_bytes())  # the payload is live ...
    assert sentinel.exists()
    sentinel.unlink()
    assert not manager.is_complete(path)
    with pytest.raises(CheckpointError) as error:  # ... but never runs here
        if loader == "load":
            _load(manager, str(path))
        else:
            manager.load_weights(str(path), model=_build()[0])
    assert str(error.value) == (
        f"{path}: not a complete checkpoint: .metadata (DCP) is unreadable: "
        "pathlib.Path.touch is not allowed in DCP metadata"
    )
    assert not sentinel.exists()
