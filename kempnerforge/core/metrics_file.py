"""Writing metrics.jsonl: appending after a torn last row, rows of JSON-safe values."""

from __future__ import annotations

import math
import numbers
import os
from typing import IO, Any

METRICS_FILE = "metrics.jsonl"
"""File name of the metrics log inside the run directory."""


def open_append(path: str) -> IO[str]:
    """Open metrics.jsonl for appending, starting a fresh line after a torn last row."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    torn = False
    if os.path.exists(path) and os.path.getsize(path) > 0:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    # Held open for the whole run and closed by MetricsTracker.close, hence no `with`.
    handle = open(path, "a", encoding="utf-8")  # noqa: SIM115
    if torn:
        handle.write("\n")
    return handle


def merge_row(row: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    clash = row.keys() & more.keys()
    if clash:
        raise ValueError(f"metric keys {sorted(clash)} are already in the row; rename them")
    return {**row, **more}


def jsonable(value: Any) -> Any:
    """The value with non-finite floats as None and non-JSON scalars converted."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, str | int):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, numbers.Integral):  # numpy integers
        return int(value)
    if isinstance(value, numbers.Real):  # numpy floats
        return jsonable(float(value))
    return str(value)
