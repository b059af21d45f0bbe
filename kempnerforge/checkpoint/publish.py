"""Moving a marked checkpoint into place, pointing `latest` at it, retention, and clearing
what interrupted saves left, touching only entries a save made.

Rank 0 runs these, and only when no write is in flight: a save still being written is
a ``step_<N>.tmp`` nothing here renames or deletes.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from kempnerforge.checkpoint.disk_format import (
    LATEST,
    LEFTOVER_DIR,
    foreign_kind,
    fsync_dir,
    is_real_dir,
    read_latest,
    read_marker,
    step_dirs,
    warn_once,
    write_latest,
)
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

STEP_NAME = re.compile(r"step_(\d+)(\.tmp|\.old)?")
"""The names a save of step N renames, deletes or writes into (check_names_free)."""


def publish(directory: Path, name: str) -> None:
    """Move a marked ``<name>.tmp`` into place as ``<name>`` and point ``latest`` at it.

    Also finishes a publish a crash interrupted. When ``<name>`` already exists it is
    swapped out through ``<name>.old``, with ``latest`` always naming a marked copy.
    """
    final, tmp, old = (directory / f"{name}{s}" for s in ("", ".tmp", ".old"))
    if read_marker(tmp) is not None:
        if final.exists():
            if read_latest(directory) in (final.name, old.name):
                write_latest(directory, tmp.name)
            if old.exists():
                shutil.rmtree(old)
            os.replace(final, old)
            fsync_dir(directory)
        if read_latest(directory) == tmp.name and read_marker(old) is not None:
            write_latest(directory, old.name)
        os.replace(tmp, final)
        fsync_dir(directory)
    if read_marker(final) is not None:
        write_latest(directory, final.name)
        if old.exists():
            shutil.rmtree(old)


def remove_leftovers(directory: Path) -> None:
    """Delete what interrupted saves left (``step_<N>.tmp/.old/.trash``), except the copy
    ``latest`` names; a link or file under such a name is no save's and stays (warned)."""
    latest = read_latest(directory)
    for path in directory.iterdir():
        if not LEFTOVER_DIR.fullmatch(path.name) or path.name == latest:
            continue
        if not is_real_dir(path):
            warn_once(
                f"leaving {path} alone: it is {foreign_kind(path)}, which no save creates "
                "(move it away to silence this)"
            )
            continue
        logger.info("removing %s, left by an interrupted save", path)
        shutil.rmtree(path)


def discard_partial(directory: Path, tmp: Path) -> None:
    """Delete what a failed save left in `tmp`, when it is a directory a save made and not
    the copy ``latest`` names; a deletion that fails too is left to the next save's
    cleanup (remove_leftovers)."""
    if is_real_dir(tmp) and read_latest(directory) != tmp.name:
        shutil.rmtree(tmp, ignore_errors=True)


def check_names_free(directory: Path, step: int) -> None:
    """Raise CheckpointError when a name that saving `step` would replace is not ours.

    A save renames and deletes ``step_<N>`` and its .tmp and .old copies, and replaces
    ``latest``: a symbolic link or a file there (or a directory named ``latest``) belongs
    to someone else and is never replaced.
    """
    pointer = directory / LATEST
    if pointer.is_dir() and not pointer.is_symlink():
        raise CheckpointError(
            pointer, "is a directory, where a save writes its pointer file; move it away"
        )
    for suffix in ("", ".tmp", ".old"):
        path = directory / f"step_{step}{suffix}"
        if (path.is_symlink() or path.exists()) and not is_real_dir(path):
            raise CheckpointError(
                path,
                f"is {foreign_kind(path)}, which saving step {step} would replace; move it away",
            )


def names_blocking_saves(directory: Path, first_step: int, last_step: int) -> list[str]:
    """What in `directory` would stop a save of any step after `first_step` up to
    `last_step` (check_names_free's refusals, found before training instead of at that
    step): a link or file named ``step_<N>`` (or its .tmp/.old copy) with N in that range,
    and a directory named ``latest``. One listing of the directory; nothing is followed.
    """
    if not directory.is_dir():
        return []
    problems = []
    pointer = directory / LATEST
    if pointer.is_dir() and not pointer.is_symlink():
        problems.append(f"{pointer} is a directory, where every save writes its pointer file")
    for path in sorted(directory.iterdir()):
        match = STEP_NAME.fullmatch(path.name)
        if not match or is_real_dir(path) or not first_step < int(match.group(1)) <= last_step:
            continue
        what = foreign_kind(path)
        if path.is_symlink():
            what = f"a symbolic link to {os.readlink(path)}"
        problems.append(f"{path} is {what}, which saving step {match.group(1)} would replace")
    return problems


def settle(directory: Path) -> None:
    """Finish a publish that a crash left with ``latest`` on a .tmp or .old copy."""
    latest = read_latest(directory) or ""
    match = LEFTOVER_DIR.fullmatch(latest)
    # Only a copy a save made: a link or file under that name is never renamed into place.
    if match and is_real_dir(directory / latest):
        publish(directory, f"step_{match.group(1)}")


def retained(steps: list[int], *, keep_last_n: int, keep_every: int) -> set[int]:
    """The steps retention keeps out of `steps` (complete checkpoints): all when
    keep_last_n is 0, else the newest keep_last_n plus every multiple of keep_every."""
    if keep_last_n == 0:
        return set(steps)
    keep = set(sorted(steps, reverse=True)[:keep_last_n])
    if keep_every > 0:
        keep |= {s for s in steps if s % keep_every == 0}
    return keep


def apply_retention(
    directory: Path, *, keep_last_n: int, keep_every: int, is_complete: Callable[[Path], bool]
) -> None:
    """Delete the complete checkpoints `retained` does not keep; never the one `latest` names.

    Incomplete ``step_<N>`` directories are left alone: they count for nothing here and
    a resume skips them with a warning. So are links and files (step_dirs leaves them
    out), and a checkpoint whose ``.trash`` name something else already holds.
    """
    if keep_last_n == 0:
        return
    latest = read_latest(directory)
    complete = {step: path for step, path in step_dirs(directory) if is_complete(path)}
    keep = retained(list(complete), keep_last_n=keep_last_n, keep_every=keep_every)
    for step, path in sorted(complete.items()):
        if step in keep or path.name == latest:
            continue
        # Rename first: a half-deleted directory must never look like a checkpoint.
        trash = path.with_name(f"{path.name}.trash")
        if trash.is_symlink() or trash.exists():
            what = foreign_kind(trash) if not is_real_dir(trash) else "a directory"
            warn_once(f"keeping {path}: {trash} is {what} that retention will not replace")
            continue
        os.replace(path, trash)
        shutil.rmtree(trash)
        logger.info(
            "removed old checkpoint %s (checkpoint.keep_last_n = %d, keep_every = %d)",
            path,
            keep_last_n,
            keep_every,
        )
