"""The manager only trusts and only touches what a save wrote: `latest`, step_<N> entries.

A `latest` that is not a pointer a save writes counts as none (with a warning); a
``step_<N>`` (or leftover) that is a link or a file is never followed, renamed or deleted.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from kempnerforge.checkpoint.manager import CheckpointError
from tests.unit.test_checkpoint import _latest, _manager, _save


def _warnings(log) -> list[str]:
    return [r.getMessage() for r in log.records if r.levelno == logging.WARNING]


def _snapshot(root: Path) -> dict[str, bytes]:
    """Every file under `root` and its bytes: what 'untouched' means."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def _names(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


BAD_LATEST = {
    "not_utf8": (
        b"\xff\xfestep_6\n",
        "it is unreadable (UnicodeDecodeError), not the pointer file a save writes",
    ),
    "not_a_step": (b"../../elsewhere\n", "it names '../../elsewhere', not a step_<N> checkpoint"),
    "empty": (b"", "it names '', not a step_<N> checkpoint"),
    "directory": (None, "it is a directory, not the pointer file a save writes"),
}


@pytest.mark.parametrize("case", list(BAD_LATEST))
def test_a_latest_that_is_no_pointer_is_ignored_with_a_warning(tmp_path, log, case):
    manager = _manager(tmp_path)
    _save(manager, 3)
    _save(manager, 6)
    latest = manager.directory / "latest"
    content, why = BAD_LATEST[case]
    latest.unlink()
    if content is None:
        latest.mkdir()
    else:
        latest.write_bytes(content)
    assert manager.find_resume_path() == str(manager.directory / "step_6")
    assert f"ignoring {latest}: {why}" in log.text
    assert (
        f"resuming from {manager.directory / 'step_6'}, the newest complete checkpoint "
        "('latest' is unusable)"
    ) in log.text
    if content is None:
        # A save never replaces a directory it did not make: it stops, naming it.
        with pytest.raises(CheckpointError) as error:
            _save(manager, 9)
        assert str(error.value) == (
            f"{latest}: is a directory, where a save writes its pointer file; move it away"
        )
        assert not (manager.directory / "step_9").exists() and latest.is_dir()
    else:
        _save(manager, 9)  # the next save writes a good pointer
        assert _latest(manager) == "step_9"


def _foreign_checkpoint(tmp_path: Path) -> Path:
    """A complete checkpoint of another run, somewhere a link may point."""
    other = _manager(tmp_path / "other")
    return Path(_save(other, 1))


def test_latest_naming_a_symlink_is_not_followed(tmp_path, log):
    manager = _manager(tmp_path)
    _save(manager, 3)
    link = manager.directory / "step_9"
    link.symlink_to(_foreign_checkpoint(tmp_path), target_is_directory=True)
    (manager.directory / "latest").write_text("step_9\n")
    assert manager.find_resume_path() == str(manager.directory / "step_3")
    assert (
        f"skipped {link} named by 'latest' (it is a symbolic link, not a checkpoint directory)"
    ) in log.text
    assert f"ignoring {link}: it is a symbolic link" in log.text


@pytest.mark.parametrize("target", ["checkpoint", "plain"])
def test_retention_never_follows_or_deletes_a_symlinked_step(tmp_path, log, target):
    if target == "checkpoint":
        elsewhere = _foreign_checkpoint(tmp_path)
    else:
        elsewhere = tmp_path / "data"
        elsewhere.mkdir()
        (elsewhere / "keep.txt").write_text("not a checkpoint")
    before = _snapshot(elsewhere)
    manager = _manager(tmp_path, keep_last_n=1)
    manager.directory.mkdir(parents=True)
    link = manager.directory / "step_1"
    link.symlink_to(elsewhere, target_is_directory=True)
    for step in (2, 3, 4):
        _save(manager, step)
    assert _names(manager.directory) == ["latest", "step_1", "step_4"]
    assert link.is_symlink() and _snapshot(elsewhere) == before
    assert manager.find_resume_path() == str(manager.directory / "step_4")
    warning = (
        f"ignoring {link}: it is a symbolic link, and checkpoints are the directories a "
        "save writes (move it away to silence this)"
    )
    assert _warnings(log).count(warning) == 1  # once, although every save met it


@pytest.mark.parametrize("name", ["step_1.tmp", "step_2.old", "step_3.trash"])
@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_leftover_cleanup_never_deletes_what_no_save_made(tmp_path, log, name, kind):
    elsewhere = tmp_path / "data"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("precious")
    manager = _manager(tmp_path, keep_last_n=1)
    manager.directory.mkdir(parents=True)
    stray = manager.directory / name
    if kind == "symlink":
        stray.symlink_to(elsewhere, target_is_directory=True)
        what = "a symbolic link"
    else:
        stray.write_text("mine")
        what = "a file, not a directory"
    for step in (4, 5, 6):
        _save(manager, step)
    assert _names(manager.directory) == sorted(["latest", name, "step_6"])
    assert _snapshot(elsewhere) == {"keep.txt": b"precious"}
    assert stray.is_symlink() if kind == "symlink" else stray.read_text() == "mine"
    warning = (
        f"leaving {stray} alone: it is {what}, which no save creates (move it away to silence this)"
    )
    assert _warnings(log).count(warning) == 1


@pytest.mark.parametrize("suffix", ["", ".tmp", ".old"])
def test_a_save_whose_names_a_link_holds_stops_naming_it(tmp_path, suffix):
    elsewhere = tmp_path / "data"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("precious")
    manager = _manager(tmp_path)
    _save(manager, 3)
    link = manager.directory / f"step_5{suffix}"
    link.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(CheckpointError) as error:
        _save(manager, 5)
    assert str(error.value) == (
        f"{link}: is a symbolic link, which saving step 5 would replace; move it away"
    )
    assert _snapshot(elsewhere) == {"keep.txt": b"precious"} and link.is_symlink()
    assert _latest(manager) == "step_3"
    _save(manager, 6)  # other steps still save
    assert _latest(manager) == "step_6"
