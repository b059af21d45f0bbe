"""CheckpointManager: exact resume, atomic commits, corrupt-checkpoint fallback, retention."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from kempnerforge.checkpoint.manager import CheckpointError, CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig

REPO = Path(__file__).resolve().parents[2]
_gen = torch.Generator().manual_seed(1234)
INPUTS = torch.randn(6, 5, 8, generator=_gen)
TARGETS = torch.randn(6, 5, 4, generator=_gen)


def _build(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, steps: range) -> list[float]:
    losses = []
    for i in steps:
        loss = ((model(INPUTS[i]) - TARGETS[i]) ** 2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _manager(root: Path, **cfg) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(**cfg), str(root / "ckpt"), config_sha256="abc")


def _save(manager: CheckpointManager, step: int, parts=None, **train_state) -> str:
    model, optimizer, scheduler = parts or _build()
    state = {"tokens_seen": 10 * step, **train_state}
    return manager.save(
        step, model=model, optimizer=optimizer, scheduler=scheduler, train_state=state
    )


def _load(manager: CheckpointManager, path: str, parts=None) -> dict:
    model, optimizer, scheduler = parts or _build(seed=99)
    return manager.load(path, model=model, optimizer=optimizer, scheduler=scheduler)


def _latest(manager: CheckpointManager) -> str:
    return (manager.directory / "latest").read_text().strip()


def test_resume_matches_uninterrupted_run(tmp_path):
    reference = _train(*_build(), range(6))
    manager = _manager(tmp_path, interval=3)
    model, optimizer, scheduler = _build()
    _train(model, optimizer, scheduler, range(3))
    saved_optimizer = copy.deepcopy(optimizer.state_dict())
    path = manager.save(
        3,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        train_state={"tokens_seen": 120, "extra": {"phase": 1}, "mine": torch.arange(3)},
    )
    assert path == str(manager.directory / "step_3")

    fresh = _build(seed=1)
    state = _load(manager, path, fresh)
    new_model, new_optimizer, new_scheduler = fresh
    for (name, p), q in zip(model.named_parameters(), new_model.parameters(), strict=True):
        assert torch.equal(p, q), name
    loaded_optimizer = new_optimizer.state_dict()
    assert loaded_optimizer["param_groups"] == saved_optimizer["param_groups"]
    for index, moments in saved_optimizer["state"].items():
        assert set(moments) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in moments.items():
            assert torch.equal(loaded_optimizer["state"][index][key], value), (index, key)
    assert new_scheduler.last_epoch == scheduler.last_epoch == 3
    assert new_scheduler.get_last_lr() == scheduler.get_last_lr()
    assert state["step"] == 3 and state["tokens_seen"] == 120
    assert state["extra"] == {"phase": 1} and torch.equal(state["mine"], torch.arange(3))
    assert set(state["rng"]) == {"python", "numpy", "torch", "cuda"}
    assert _train(*fresh, range(3, 6)) == reference[3:]  # bitwise, not approximately


def test_layout_marker_and_latest(tmp_path):
    manager = _manager(tmp_path)
    _save(manager, 30)
    step_dir = manager.directory / "step_30"
    assert sorted(os.listdir(manager.directory)) == ["latest", "step_30"]
    assert {".metadata", "complete.json", "train_state_rank0.pt"} <= set(os.listdir(step_dir))
    assert any(name.endswith(".distcp") for name in os.listdir(step_dir))
    marker = json.loads((step_dir / "complete.json").read_text())
    assert marker["step"] == 30 and marker["tokens_seen"] == 300 and marker["world_size"] == 1
    assert marker["format_version"] == 1 and marker["config_sha256"] == "abc" and marker["time"]
    assert (manager.directory / "latest").read_text() == "step_30\n"
    assert manager.is_complete(step_dir)


def test_save_before_the_first_step_changes_nothing(tmp_path):
    reference = _train(*_build(), range(3))
    manager = _manager(tmp_path)
    parts = _build()
    path = _save(manager, 0, parts)
    assert _train(*parts, range(3)) == reference  # saving did not touch the live optimizer
    fresh = _build(seed=5)
    _load(manager, path, fresh)
    assert _train(*fresh, range(3)) == reference


def test_schedule():
    manager = CheckpointManager(CheckpointConfig(interval=10), "unused")
    assert [s for s in range(0, 35) if manager.should_save(s, max_steps=25)] == [10, 20]
    assert manager.is_on_schedule(30) and not manager.is_on_schedule(0)
    never = CheckpointManager(CheckpointConfig(interval=0), "unused")
    assert not any(never.should_save(s, max_steps=5) for s in range(6))


def test_crash_before_the_marker_keeps_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    manager = _manager(tmp_path)
    _save(manager, 3)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("kempnerforge.checkpoint.saver.write_marker", crash)
    with pytest.raises(CheckpointError, match="disk full"):
        _save(manager, 6)  # a failed save: reported, and what it wrote removed
    assert _latest(manager) == "step_3"
    assert not (manager.directory / "step_6.tmp").exists()
    assert not (manager.directory / "step_6").exists()
    assert manager.find_resume_path() == str(manager.directory / "step_3")
    monkeypatch.undo()
    _save(manager, 6)  # the next save cleans the leftover
    assert sorted(os.listdir(manager.directory)) == ["latest", "step_3", "step_6"]


@pytest.mark.parametrize("resave", [False, True], ids=["new_step", "same_step"])
def test_a_crash_at_any_rename_leaves_latest_on_a_complete_checkpoint(
    tmp_path, monkeypatch, resave
):
    manager = _manager(tmp_path)
    _save(manager, 3)
    step = 3 if resave else 6
    real_replace = os.replace
    crashed_at = 0
    while True:
        calls = 0

        def replace(src, dst, _crash_at=crashed_at + 1):
            nonlocal calls
            calls += 1
            if calls == _crash_at:
                raise OSError(f"crash at rename {calls}")
            real_replace(src, dst)

        monkeypatch.setattr(os, "replace", replace)
        try:
            _save(manager, step)
        except (OSError, CheckpointError):  # a failed rename fails the save, reported
            crashed_at += 1
        else:
            break
        finally:
            monkeypatch.setattr(os, "replace", real_replace)
        latest = _latest(manager)
        assert manager.is_complete(manager.directory / latest), (crashed_at, latest)
        resume = manager.find_resume_path()
        assert resume is not None and manager.is_complete(resume)
        assert _load(manager, resume)["step"] in (3, step)
    assert crashed_at >= 3  # the atomic writes and the directory rename were all exercised
    assert _latest(manager) == f"step_{step}"
    assert sorted(os.listdir(manager.directory)) == sorted({"latest", "step_3", f"step_{step}"})


def test_a_leftover_tmp_is_ignored_and_cleaned_by_the_next_save(tmp_path):
    manager = _manager(tmp_path)
    _save(manager, 3)
    leftover = manager.directory / "step_9.tmp"
    leftover.mkdir()
    (leftover / "complete.json").write_text('{"step": 9}')
    assert manager.find_resume_path() == str(manager.directory / "step_3")
    _save(manager, 4)
    assert not leftover.exists()


def _corrupt(path: Path, how: str) -> None:
    if how == "marker_deleted":
        (path / "complete.json").unlink()
    elif how == "distcp_truncated":
        shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "metadata_deleted":
        (path / ".metadata").unlink()
    elif how == "train_state_truncated":
        file = path / "train_state_rank0.pt"
        file.write_bytes(file.read_bytes()[:-30])


CORRUPTIONS = ["marker_deleted", "distcp_truncated", "metadata_deleted", "train_state_truncated"]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_auto_falls_back_past_a_corrupt_checkpoint(tmp_path, log, how):
    manager = _manager(tmp_path)
    _save(manager, 3)
    _save(manager, 6)
    newest = manager.directory / "step_6"
    _corrupt(newest, how)
    assert not manager.is_complete(newest)
    assert manager.find_resume_path() == str(manager.directory / "step_3")
    assert str(newest) in log.text and "WARNING" in log.text


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_an_explicit_corrupt_path_raises_naming_it(tmp_path, how):
    manager = _manager(tmp_path)
    _save(manager, 3)
    _corrupt(manager.directory / "step_3", how)
    path = str(manager.directory / "step_3")
    explicit = _manager(tmp_path, resume_from=path)
    with pytest.raises(CheckpointError, match="not a complete checkpoint") as error:
        explicit.find_resume_path()
    assert error.value.path == path and path in str(error.value)
    with pytest.raises(CheckpointError) as error:
        _load(manager, path)
    assert path in str(error.value)


def test_auto_with_only_broken_checkpoints_raises_instead_of_starting_over(tmp_path):
    manager = _manager(tmp_path)
    _save(manager, 3)
    _corrupt(manager.directory / "step_3", "marker_deleted")
    with pytest.raises(CheckpointError, match="complete.json is missing"):
        manager.find_resume_path()


def test_auto_without_latest_takes_the_newest_complete_with_a_warning(tmp_path, log):
    manager = _manager(tmp_path)
    _save(manager, 3)
    _save(manager, 12)
    (manager.directory / "latest").unlink()
    assert manager.find_resume_path() == str(manager.directory / "step_12")
    assert "no 'latest' file" in log.text


def test_resume_from_choices(tmp_path):
    assert _manager(tmp_path).find_resume_path() is None  # nothing saved yet
    _save(_manager(tmp_path), 3)
    assert _manager(tmp_path, resume_from="none").find_resume_path() is None
    step_dir = str(tmp_path / "ckpt" / "step_3")
    assert _manager(tmp_path, resume_from=step_dir).find_resume_path() == step_dir
    assert _manager(tmp_path, resume_from="step_3").find_resume_path() == step_dir
    with pytest.raises(CheckpointError, match="does not exist"):
        _manager(tmp_path, resume_from=str(tmp_path / "nope")).find_resume_path()


def test_retention_keeps_the_newest_n(tmp_path):
    manager = _manager(tmp_path, keep_last_n=2)
    for step in range(1, 6):
        _save(manager, step)
    assert sorted(os.listdir(manager.directory)) == ["latest", "step_4", "step_5"]


def test_retention_never_deletes_the_checkpoint_latest_names(tmp_path):
    manager = _manager(tmp_path, keep_last_n=2)
    _save(manager, 10)
    _save(manager, 20)
    _save(manager, 5)  # e.g. a run resumed from an older checkpoint
    assert _latest(manager) == "step_5"
    assert sorted(os.listdir(manager.directory)) == ["latest", "step_10", "step_20", "step_5"]


def test_a_train_state_a_weights_only_load_would_refuse_fails_at_save(tmp_path):
    manager = _manager(tmp_path)
    with pytest.raises(TypeError, match=r"train_state\['extra'\]\['count'\] is a int64"):
        _save(manager, 3, extra={"count": np.int64(3)})
    with pytest.raises(ValueError, match="reserved"):
        _save(manager, 3, scheduler={})
    assert not (manager.directory / "step_3").exists()


def test_loading_into_a_different_model_names_the_checkpoint(tmp_path):
    manager = _manager(tmp_path)
    path = _save(manager, 3)
    torch.manual_seed(0)
    other = nn.Sequential(nn.Linear(8, 16))
    optimizer = torch.optim.AdamW(other.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    with pytest.raises(CheckpointError, match="do not exist in this model") as error:
        manager.load(path, model=other, optimizer=optimizer, scheduler=scheduler)
    assert path in str(error.value)


def test_newest_complete_path_ignores_resume_from_and_broken_checkpoints(tmp_path):
    manager = _manager(tmp_path, resume_from="none")
    assert manager.newest_complete_path() is None
    _save(manager, 3)
    _save(manager, 6)
    assert manager.newest_complete_path() == str(manager.directory / "step_6")
    _corrupt(manager.directory / "step_6", "marker_deleted")
    assert manager.newest_complete_path() == str(manager.directory / "step_3")
    _corrupt(manager.directory / "step_3", "metadata_deleted")
    assert manager.newest_complete_path() is None


def test_read_extra_returns_the_saved_extra_only(tmp_path):
    manager = _manager(tmp_path)
    path = _save(manager, 3, extra={"math": {"dim": 8}})
    assert manager.read_extra(path) == {"math": {"dim": 8}}
    (Path(path) / "complete.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.read_extra(path)


def test_read_train_state_returns_what_load_returns_and_loads_nothing(tmp_path):
    manager = _manager(tmp_path)
    parts = _build()
    _train(*parts, range(2))
    path = _save(manager, 2, parts, extra={"phase": 1})
    model, optimizer, scheduler = _build(seed=8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = manager.read_train_state(path)
    assert state["step"] == 2 and state["tokens_seen"] == 20 and state["extra"] == {"phase": 1}
    assert state["scheduler"] == parts[2].state_dict()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not optimizer.state and scheduler.last_epoch == 0
    loaded = manager.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
    assert loaded.keys() == state.keys() and loaded["rng"]["python"]["version"] == 3
    (Path(path) / "complete.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.read_train_state(path)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_wait_with_nothing_in_flight_commits_and_touches_nothing(tmp_path, mode):
    manager = _manager(tmp_path, async_mode=mode)
    _save(manager, 1)
    manager.wait()  # async: commits step 1; sync: nothing was in flight
    commits = []
    manager.on_commit = lambda *args: commits.append(args)
    files = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in manager.directory.rglob("*")}
    manager.wait()
    assert commits == [] and manager.pending_step is None
    after = {p: (p.stat().st_mtime_ns, p.stat().st_size) for p in manager.directory.rglob("*")}
    assert after == files
    assert _latest(manager) == "step_1" and manager.is_complete(manager.directory / "step_1")


def test_importing_checkpoint_errors_does_not_import_torch():
    # The CLI imports CheckpointError at startup; torch would cost it seconds per --help.
    code = "import kempnerforge.core.errors, sys; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    code = (
        "from kempnerforge.checkpoint import CheckpointError, CheckpointManager; "
        "from kempnerforge.checkpoint import manager; from kempnerforge.core import errors; "
        "assert CheckpointManager is manager.CheckpointManager; "
        "assert CheckpointError is errors.CheckpointError is manager.CheckpointError"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
