"""Async checkpointing: state captured at save(), commit only when durable, failures, retention."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from kempnerforge.checkpoint import background
from kempnerforge.checkpoint.manager import CheckpointError, CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from tests.unit.test_checkpoint import _build, _latest, _load, _manager, _save, _train


def _async(root: Path, **cfg) -> CheckpointManager:
    return _manager(root, async_mode="async", **cfg)


def _names(manager: CheckpointManager) -> list[str]:
    return sorted(os.listdir(manager.directory))


class _HeldWrite(threading.Event):
    """Set to let DCP writes through; `events` records, in order, each write that starts
    waiting, each that starts writing, and what the test notes itself."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []


@pytest.fixture
def held_write(monkeypatch):
    """A _HeldWrite that holds every DCP write (before its first byte) until it is set."""
    release = _HeldWrite()
    real = FileSystemWriter.write_data

    def write_data(self, *args, **kwargs):
        release.events.append("write waits")
        assert release.wait(30), "the test never released the write"
        release.events.append("write starts")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    yield release
    release.set()


@pytest.fixture
def held_commit(monkeypatch):
    """An Event that holds every finished background write before its marker until set."""
    release = threading.Event()
    monkeypatch.setattr(background, "fault_save_delay", lambda step: release.wait(30))
    yield release
    release.set()


def _disk_full_write(self, *args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def disk_full(monkeypatch):
    return lambda: monkeypatch.setattr(FileSystemWriter, "write_data", _disk_full_write)


def _poll_until_committed(manager: CheckpointManager) -> str:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        path = manager.poll()
        if path is not None:
            return path
        time.sleep(0.01)
    raise AssertionError("the background save never finished")


def test_async_save_writes_the_state_at_save_time(tmp_path, held_write):
    reference = _train(*_build(), range(6))
    manager = _async(tmp_path)
    parts = _build()
    model, optimizer, _ = parts
    _train(*parts, range(3))
    path = _save(manager, 3, parts)
    assert path == str(manager.directory / "step_3") and manager.pending_step == 3
    # The write has not started: everything below happens before DCP reads a byte.
    _train(*parts, range(3, 5))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1000.0)
        for moments in optimizer.state.values():
            moments["exp_avg"].zero_()
    held_write.events.append("state changed")
    held_write.set()
    manager.wait()
    # The change really happened while the save was in flight, before its write began.
    assert held_write.events.count("write starts") == 1
    assert held_write.events.index("state changed") < held_write.events.index("write starts")
    assert manager.pending_step is None and manager.is_complete(path)
    fresh = _build(seed=1)
    assert _load(manager, path, fresh)["step"] == 3
    assert _train(*fresh, range(3, 6)) == reference[3:]  # bitwise: the step-3 state


def test_every_async_save_holds_its_own_step_although_staging_buffers_are_reused(tmp_path):
    manager = _async(tmp_path)
    parts = _build()
    expected = {}
    for step in (1, 2, 3):
        _train(*parts, range(step - 1, step))
        expected[step] = {n: p.detach().clone() for n, p in parts[0].named_parameters()}
        _save(manager, step, parts)
    manager.wait()
    for step, params in expected.items():
        model = _build(seed=9)[0]
        manager.load_weights(str(manager.directory / f"step_{step}"), model=model)
        for name, param in model.named_parameters():
            assert torch.equal(param, params[name]), (step, name)


def test_two_quick_async_saves_commit_in_order(tmp_path, held_commit):
    manager = _async(tmp_path)
    _save(manager, 1)
    assert not (manager.directory / "latest").exists()
    held_commit.set()
    _save(manager, 2)  # waits for step 1 and commits it before starting
    assert _latest(manager) == "step_1" and manager.is_complete(manager.directory / "step_1")
    assert manager.pending_step == 2
    manager.wait()
    assert _latest(manager) == "step_2" and manager.pending_step is None
    assert _names(manager) == ["latest", "step_1", "step_2"]


def test_latest_never_names_an_uncommitted_checkpoint(tmp_path, held_commit):
    manager = _async(tmp_path)
    held_commit.set()
    _save(manager, 3)
    manager.wait()
    held_commit.clear()
    _save(manager, 6)
    for _ in range(3):  # the files may be written, but nothing is committed yet
        assert manager.poll() is None  # returns although the write cannot finish
        assert _latest(manager) == "step_3" and manager.pending_step == 6
        assert not (manager.directory / "step_6").exists()
        assert (manager.directory / "step_6.tmp").is_dir()
        assert not (manager.directory / "step_6.tmp" / "complete.json").exists()
    held_commit.set()
    assert _poll_until_committed(manager) == str(manager.directory / "step_6")
    assert _latest(manager) == "step_6" and manager.pending_step is None
    assert manager.poll() is None
    assert _names(manager) == ["latest", "step_3", "step_6"]


def test_load_commits_the_save_in_flight_first(tmp_path):
    manager = _async(tmp_path)
    path = _save(manager, 4)
    assert _load(manager, path)["step"] == 4 and manager.pending_step is None


@pytest.mark.parametrize("surfaces_in", ["wait", "save", "poll"])
def test_a_failed_background_write_raises_naming_the_directory(tmp_path, disk_full, surfaces_in):
    manager = _async(tmp_path)
    _save(manager, 3)
    manager.wait()
    disk_full()
    _save(manager, 6)  # returns: the failure happens in the background
    with pytest.raises(CheckpointError) as error:
        if surfaces_in == "wait":
            manager.wait()
        elif surfaces_in == "save":
            _save(manager, 9)
        else:
            _poll_until_committed(manager)
    assert error.value.path == str(manager.directory)
    free = error.value.bytes_free
    assert isinstance(free, int) and free > 0  # the disk is full for the writer only
    assert str(error.value) == (
        f"{manager.directory}: the background write of checkpoint step_6 into "
        f"{manager.directory / 'step_6.tmp'} failed, so it was not committed "
        f"(the disk is full: {free} bytes free on the file system of {manager.directory} "
        "(rank 0: OSError: [Errno 28] No space left on device)); 'latest' still names step_3"
    )
    assert manager.pending_step is None
    manager.wait()  # raised once, then cleared
    assert _latest(manager) == "step_3" and manager.is_complete(manager.directory / "step_3")
    assert _names(manager) == ["latest", "step_3"]
    assert manager.find_resume_path() == str(manager.directory / "step_3")


def test_a_failed_sync_write_raises_naming_the_directory(tmp_path, disk_full):
    manager = _manager(tmp_path)
    _save(manager, 3)
    disk_full()
    with pytest.raises(CheckpointError) as error:
        _save(manager, 6)
    assert error.value.path == str(manager.directory)
    free = error.value.bytes_free
    assert str(error.value) == (
        f"{manager.directory}: writing checkpoint step_6 into "
        f"{manager.directory / 'step_6.tmp'} failed, so it was not committed "
        f"(the disk is full: {free} bytes free on the file system of {manager.directory} "
        "(rank 0: OSError: [Errno 28] No space left on device)); 'latest' still names step_3"
    )
    assert _names(manager) == ["latest", "step_3"]  # the partial step_6.tmp is gone
    assert _latest(manager) == "step_3" and manager.is_complete(manager.directory / "step_3")
    assert manager.find_resume_path() == str(manager.directory / "step_3")


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_an_uncreatable_directory_raises_naming_it(tmp_path, mode):
    # A file where a parent directory must be: refused for root too, unlike a chmod.
    blocker = tmp_path / "runs"
    blocker.write_text("not a directory")
    directory = blocker / "ckpt"
    manager = CheckpointManager(CheckpointConfig(async_mode=mode), str(directory))
    with pytest.raises(CheckpointError) as error:
        _save(manager, 6)
        manager.wait()
    assert error.value.path == str(directory)
    assert str(error.value) == (
        f"{directory}: writing checkpoint step_6 into {directory / 'step_6.tmp'} failed, so "
        f"it was not committed (NotADirectoryError: [Errno 20] Not a directory: "
        f"'{directory}'); no earlier checkpoint exists"
    )
    assert manager.pending_step is None and blocker.read_text() == "not a directory"
    blocker.unlink()  # the problem fixed, the same manager saves
    _save(manager, 6)
    manager.wait()
    assert _latest(manager) == "step_6" and manager.is_complete(directory / "step_6")


def test_fault_delay_applies_from_the_configured_step(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr(background.time, "sleep", slept.append)
    monkeypatch.delenv(background.FAULT_SAVE_DELAY_ENV, raising=False)
    background.fault_save_delay(10)
    monkeypatch.setenv(background.FAULT_SAVE_DELAY_ENV, "2.5")
    monkeypatch.setenv(background.FAULT_SAVE_DELAY_FROM_STEP_ENV, "10")
    background.fault_save_delay(5)
    background.fault_save_delay(10)
    assert slept == [2.5]


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_keep_every_keeps_multiples_besides_the_newest(tmp_path, mode):
    manager = _manager(tmp_path, async_mode=mode, keep_last_n=1, keep_every=4)
    for step in range(1, 10):
        _save(manager, step)
        if mode == "async":
            assert (manager.directory / f"step_{step}.tmp").is_dir()  # in flight, untouched
    manager.wait()
    assert _names(manager) == ["latest", "step_4", "step_8", "step_9"]
    _save(manager, 2)  # a run resumed from an older point: latest is kept too
    manager.wait()
    assert _names(manager) == ["latest", "step_2", "step_4", "step_8", "step_9"]


def test_retention_keeps_the_last_good_checkpoint_while_one_is_written(tmp_path, held_commit):
    manager = _async(tmp_path, keep_last_n=1)
    held_commit.set()
    _save(manager, 1)
    manager.wait()
    held_commit.clear()
    _save(manager, 2)
    assert _names(manager) == ["latest", "step_1", "step_2.tmp"]
    held_commit.set()
    manager.wait()
    assert _names(manager) == ["latest", "step_2"]


def test_load_weights_loads_only_the_model(tmp_path):
    manager = _manager(tmp_path)
    parts = _build()
    _train(*parts, range(3))
    path = _save(manager, 3, parts)
    model, optimizer, scheduler = _build(seed=8)
    manager.load_weights(path, model=model)
    for (name, p), q in zip(parts[0].named_parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not optimizer.state and scheduler.last_epoch == 0  # nothing else was restored

    other = nn.Sequential(nn.Linear(8, 16))
    with pytest.raises(CheckpointError, match="do not exist in this model") as error:
        manager.load_weights(path, model=other)
    assert error.value.path == path
    (Path(path) / "complete.json").unlink()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        manager.load_weights(path, model=model)


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_on_commit_reports_each_checkpoint_once_it_is_complete(tmp_path, held_commit, mode):
    manager = _manager(tmp_path, async_mode=mode)
    commits = []
    manager.on_commit = lambda step, path, seconds: commits.append(
        (step, os.path.basename(path), manager.is_complete(path), seconds >= 0)
    )
    if mode == "disabled":
        held_commit.set()  # a sync save holds nothing back
    _save(manager, 1)
    assert commits == ([] if mode == "async" else [(1, "step_1", True, True)])
    held_commit.set()
    _save(manager, 2)  # async: commits step 1 before starting
    manager.wait()
    assert commits == [(1, "step_1", True, True), (2, "step_2", True, True)]
    manager.wait()  # nothing in flight: nothing reported again
    assert len(commits) == 2
