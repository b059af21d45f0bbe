"""A run's metrics.jsonl in tests, read with the package's own reader (core/metrics_file.py).

Rows of a finished run are read strictly: every line must be a standard JSON object, so a
malformed row fails the test. ``live`` reads a run still going (or killed): no file yet is
no rows, and a torn last row is skipped.
"""

from __future__ import annotations

import os
from typing import Any

from kempnerforge.core.metrics_file import METRICS_FILE
from kempnerforge.core.metrics_file import read_rows as read_file_rows

RunDir = str | os.PathLike[str]


def read_rows(run_dir: RunDir, *, live: bool = False) -> list[dict[str, Any]]:
    """Every row of ``run_dir``/metrics.jsonl, in logged order."""
    path = os.path.join(run_dir, METRICS_FILE)
    if live and not os.path.exists(path):
        return []
    return read_file_rows(path, strict=not live)


def train_rows(run_dir: RunDir, *, live: bool = False) -> list[dict[str, Any]]:
    """The per-step training rows (events and eval rows left out), in logged order."""
    return [r for r in read_rows(run_dir, live=live) if "loss" in r and "event" not in r]


def eval_rows(run_dir: RunDir) -> list[dict[str, Any]]:
    """The eval rows (events left out), in logged order."""
    return [r for r in read_rows(run_dir) if "eval_loss" in r and "event" not in r]


def events(run_dir: RunDir, name: str) -> list[dict[str, Any]]:
    """The rows of the event ``name`` ('checkpoint', 'resume', 'nan_skip', ...)."""
    return [r for r in read_rows(run_dir) if r.get("event") == name]
