"""metrics.jsonl: appending after a torn last row, rows of JSON-safe values, reading rows."""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Callable, Iterator
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


def iter_rows(path: str | os.PathLike[str], *, strict: bool = False) -> Iterator[dict[str, Any]]:
    """The rows of the metrics.jsonl at ``path``, in file order.

    A line that is not a JSON object is skipped: a killed run leaves a torn last row, and a
    resumed run appends after it (open_append). With ``strict`` such a line raises
    ValueError naming the file and line instead, and so does NaN or Infinity, which the
    writer never emits (jsonable writes a non-finite value as null): for a reader that
    expects every row of a finished run.
    """
    decoder = json.JSONDecoder(parse_constant=_refuse_constant) if strict else json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            try:
                row = decoder.decode(line)
            except ValueError as error:
                if strict:
                    raise ValueError(f"{path}, line {number}: not a metrics row: {error}") from None
                continue
            if isinstance(row, dict):
                yield row
            elif strict:
                raise ValueError(f"{path}, line {number}: not a metrics row: not a JSON object")


def read_rows(path: str | os.PathLike[str], *, strict: bool = False) -> list[dict[str, Any]]:
    """Every row of the metrics.jsonl at ``path`` (see iter_rows), as a list."""
    return list(iter_rows(path, strict=strict))


TAIL_BYTES = 256 << 10
"""The end of a metrics.jsonl read_tail_rows reads first: a few hundred rows."""


def read_tail_rows(
    path: str | os.PathLike[str], count: int, keep: Callable[[dict[str, Any]], bool]
) -> list[dict[str, Any]]:
    """The newest ``count`` rows ``keep`` accepts of the metrics.jsonl at ``path``, in file
    order, read from its end: TAIL_BYTES, doubled until enough rows are found or the whole
    file is read. A long run's file (hundreds of MB) costs what its last rows do."""
    size = os.path.getsize(path)
    span = TAIL_BYTES
    while True:
        start = max(0, size - span)
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
        lines = data.split(b"\n")
        if start > 0:
            lines = lines[1:]  # the first may be a row's end only
        rows = []
        for line in lines:
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a torn row, as iter_rows skips it
            if isinstance(row, dict) and keep(row):
                rows.append(row)
        if len(rows) >= count or start == 0:
            return rows[-count:] if count else []
        span *= 2


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
