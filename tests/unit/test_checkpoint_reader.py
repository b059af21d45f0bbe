"""DCP loads read ``.metadata`` through the allow-list too, not only the completeness check.

``read_dcp`` is called directly here, skipping the check a manager load runs first: the
state a ``.metadata`` swapped in between that check and the load would meet.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from kempnerforge.checkpoint.dcp_metadata import read_dcp_metadata
from kempnerforge.checkpoint.manager import CheckpointError
from kempnerforge.checkpoint.reader import AllowListedReader
from kempnerforge.checkpoint.resume import read_dcp
from tests.unit.test_checkpoint import _build, _manager, _save, _train
from tests.unit.test_checkpoint_security import _Payload


def _saved(tmp_path: Path) -> tuple[Path, dict, dict]:
    """A checkpoint of a model trained two steps, with the state dicts it saved."""
    parts = _build()
    _train(*parts, range(2))
    path = Path(_save(_manager(tmp_path), 2, parts))
    model_sd, optim_sd = get_state_dict(parts[0], parts[1])
    return path, model_sd, optim_sd


def _fresh_state() -> dict:
    """Model and optimizer state of a differently seeded model, stepped once so the
    optimizer has state to load into."""
    model, optimizer, scheduler = _build(seed=7)
    _train(model, optimizer, scheduler, range(1))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def test_a_swapped_metadata_never_runs_inside_the_dcp_load(tmp_path):
    path, _, _ = _saved(tmp_path)
    sentinel = tmp_path / "pwned"
    (path / ".metadata").write_bytes(pickle.dumps(_Payload(sentinel)))
    pickle.loads((path / ".metadata").read_bytes())  # the payload is live ...
    assert sentinel.exists()
    sentinel.unlink()
    with pytest.raises(CheckpointError) as error:  # ... but never runs here
        read_dcp(path, _fresh_state(), "model/optimizer do not load", None, True)
    assert not sentinel.exists()
    assert str(error.value) == (
        f"{path}: .metadata (DCP) is unreadable: pathlib.Path.touch is not allowed in DCP metadata"
    )
    assert error.value.path == str(path)


def test_read_dcp_loads_a_checkpoint_bitwise(tmp_path):
    path, model_sd, optim_sd = _saved(tmp_path)
    state = _fresh_state()
    assert not torch.equal(state["model"]["0.weight"], model_sd["0.weight"])
    read_dcp(path, state, "model/optimizer do not load", None, True)
    assert state["model"].keys() == model_sd.keys()
    for key, value in model_sd.items():
        assert torch.equal(state["model"][key], value), key
    for key, saved in optim_sd["state"].items():
        for name, value in saved.items():
            assert torch.equal(state["optimizer"]["state"][key][name], value), (key, name)
    assert state["optimizer"]["param_groups"] == optim_sd["param_groups"]


def test_the_reader_tags_the_metadata_with_its_load_id(tmp_path):
    path, _, _ = _saved(tmp_path)
    reader = AllowListedReader(path)
    metadata = reader.read_metadata()
    assert metadata.state_dict_metadata == read_dcp_metadata(path).state_dict_metadata
    assert metadata.storage_meta is not None
    assert metadata.storage_meta.load_id == reader.load_id
    assert reader.refusal is None


def test_the_reader_refuses_rank_local_metadata(tmp_path):
    path, _, _ = _saved(tmp_path)
    reader = AllowListedReader(path)
    with pytest.raises(CheckpointError) as error:
        reader.read_metadata(rank=0)
    assert str(error.value) == f"{path}: has no rank-local DCP metadata to read"
