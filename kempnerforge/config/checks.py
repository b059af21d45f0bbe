"""Tiny validation helpers shared by the section dataclasses."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from kempnerforge.config.errors import ConfigError, closest_name

_TABLE_NAME = re.compile(r"[A-Za-z0-9_-]+")


def check_named_paths(field: str, tables: Sequence[Any], kind: str) -> None:
    """Arrays of ``{name, path}`` tables ([[data.datasets]], [[eval.sets]]): each name made of
    [A-Za-z0-9_-] (it becomes part of metric keys) and unique, each path non-empty.

    ``field`` is the array's dotted name, ``kind`` what one table is ("dataset").
    """
    seen: set[str] = set()
    for i, table in enumerate(tables):
        where = f"{field}[{i}]"
        if not _TABLE_NAME.fullmatch(table.name):
            raise ConfigError(f"{where}.name", table.name, "a non-empty name of [A-Za-z0-9_-]")
        if table.name in seen:
            raise ConfigError(
                f"{where}.name", table.name, f"a name no other {kind} has", "duplicate"
            )
        seen.add(table.name)
        if not table.path:
            raise ConfigError(f"{where}.path", table.path, "a prepare-data directory")


def check_at_least(field: str, value: float, minimum: float) -> None:
    if not (math.isfinite(value) and value >= minimum):
        kind = "an integer" if isinstance(value, int) else "a number"
        raise ConfigError(field, value, f"{kind} >= {minimum}")


def check_positive(field: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        kind = "an integer" if isinstance(value, int) else "a number"
        raise ConfigError(field, value, f"{kind} > 0")


def check_in_range(field: str, value: float, low: float, high: float) -> None:
    """Closed interval [low, high]."""
    if not (math.isfinite(value) and low <= value <= high):
        raise ConfigError(field, value, f"a number in [{low}, {high}]")


def check_choice(field: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        suggestion = closest_name(str(value), [str(c) for c in choices])
        hint = f"did you mean {suggestion!r}?" if suggestion else ""
        raise ConfigError(field, value, "one of " + ", ".join(map(repr, choices)), hint)
