"""Bad data windows: the ones a fault was traced to, the run-level file that lists them, and
the stand-in read in place of each.

A window found to blow up the loss every time it is trained on is recorded as (dataset
path, window id, window length) and never read again: the dataset reads a stand-in, the next
window in file order that is not bad. The substitution happens where a window is read, so
every position of the data order keeps its meaning: the same number of batches on every
rank, the same order for every other window, and a saved position that resumes exactly at
any data-parallel size or worker count.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kempnerforge.core.errors import DataError

BAD_DATA_FILE = "bad_data.jsonl"
"""The run-level list of bad windows, in the checkpoint directory: one JSON object a line."""


@dataclass(frozen=True, order=True)
class BadWindow:
    """One window of one dataset: tokens ``[window * seq_len, (window + 1) * seq_len]`` of a
    prepared directory, or entry ``window`` of an image-text index (``seq_len`` 0)."""

    path: str
    window: int
    seq_len: int


def next_good_window(index: int, bad: frozenset[int], size: int, path: str) -> int:
    """The window read for ``index``: itself, or for a bad one the next window in file order
    (wrapping at the end) that is not bad. O(1) unless bad windows are adjacent."""
    if index not in bad:
        return index
    for offset in range(1, size):
        window = (index + offset) % size
        if window not in bad:
            return window
    raise DataError(
        f"{path}: all {size} of its windows are recorded as bad data ({BAD_DATA_FILE} in the "
        "checkpoint directory); check the data, then remove those lines to train on it again"
    )


class BadWindowSkipping:
    """What every training dataset does with its bad windows: ``skip_windows`` lists them
    (DataPipeline.add_bad_windows sets it), and sample ``index`` reads ``window_for(index)``,
    the stand-in for a bad one, so the token and the image-text datasets skip alike.

    Mixed in ahead of torch's Dataset by a dataset with a ``path`` and windows ``0`` to
    ``len - 1``; set on the instance, the list travels to the loader's workers with it.
    """

    path: str
    skip_windows: frozenset[int] = frozenset()
    """Windows recorded as bad data: each is read as the next good one."""

    def __len__(self) -> int:
        raise NotImplementedError

    def window_for(self, index: int) -> int:
        """The window sample ``index`` reads: itself, unless it is recorded as bad data."""
        return next_good_window(index, self.skip_windows, len(self), self.path)


class BadWindows:
    """The set of bad windows of a run, by dataset; small (one entry per fault traced)."""

    def __init__(self, windows: Iterable[BadWindow] = ()) -> None:
        self._windows: set[BadWindow] = set(windows)

    def __len__(self) -> int:
        return len(self._windows)

    def __iter__(self) -> Iterator[BadWindow]:
        return iter(sorted(self._windows))

    def __contains__(self, window: object) -> bool:
        return window in self._windows

    def add(self, windows: Iterable[BadWindow]) -> list[BadWindow]:
        """Add ``windows``; return the ones not known before, in order."""
        new = sorted(set(windows) - self._windows)
        self._windows.update(new)
        return new

    def of(self, path: str, seq_len: int) -> frozenset[int]:
        """The bad window ids of the dataset at ``path`` read in windows of ``seq_len``."""
        return frozenset(w.window for w in self._windows if (w.path, w.seq_len) == (path, seq_len))

    def state_dict(self) -> list[list[Any]]:
        return [[w.path, w.window, w.seq_len] for w in self]

    def load_state_dict(self, state: list[list[Any]]) -> list[BadWindow]:
        """Add the windows of a saved state (a resume keeps what it already knows)."""
        return self.add(BadWindow(str(p), int(w), int(n)) for p, w, n in state)


def read_bad_data(directory: str | os.PathLike[str]) -> list[BadWindow]:
    """The windows listed in ``directory``/bad_data.jsonl; none when there is no file.

    Raises DataError naming the file and line when a line is not a window record.
    """
    path = Path(directory) / BAD_DATA_FILE
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return []
    windows = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            windows.append(BadWindow(str(row["path"]), int(row["window"]), int(row["seq_len"])))
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(
                f"{path}, line {number}: not a bad-window record ({e}); each line must be a "
                'JSON object {"path": ..., "window": ..., "seq_len": ...}: fix or delete it'
            ) from None
    return windows


def write_bad_data(
    directory: str | os.PathLike[str], windows: Iterable[BadWindow], step: int
) -> str:
    """Add ``windows`` (found at ``step``) to ``directory``/bad_data.jsonl, atomically.

    The whole file is written beside it and renamed over it, so a crash leaves the old list
    or the new one, never half a line. Call on one rank only. Returns the file's path.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / BAD_DATA_FILE
    try:
        old = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        old = ""
    if old and not old.endswith("\n"):
        old += "\n"
    rows = [
        json.dumps({"path": w.path, "window": w.window, "seq_len": w.seq_len, "step": step})
        for w in windows
    ]
    temporary = directory / f".{BAD_DATA_FILE}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.write(old + "".join(row + "\n" for row in rows))
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    return str(path)
