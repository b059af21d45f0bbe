"""Tiny validation helpers shared by the section dataclasses, and the shared upper bounds."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

from kempnerforge.core.errors import ConfigError, closest_name

_TABLE_NAME = re.compile(r"[A-Za-z0-9_-]+")

MAX_SIZE = 2**31 - 1
"""Largest tensor size, head count or per-step count: many kernels index a dimension with a
32-bit int, and no real model comes near it."""
MAX_LAYERS = 2**16
"""Most Transformer blocks: the largest published models have about 130; the config's rules
look at every layer (which are MoE, which slide), so a count near MAX_SIZE would keep
validation busy for minutes instead of refusing it."""
MAX_STEPS = 2**62 - 1
"""Largest step count or step number: leaves headroom below int64 for step arithmetic
(step + interval, tokens seen) in tensors and checkpoint metadata."""
MAX_SEED = 2**63 - 1
"""Largest seed: the largest signed 64-bit int, so that torch generators, int64 tensors and
checkpoint metadata all hold it unchanged."""
MAX_LR = 10.0
"""Largest learning rate (and learning-rate scale): practical peaks are 1e-5 to 1e-1 for
every optimizer here; above 10 one step moves weights of init scale 0.02 by 500x their
size, which can only diverge."""
MAX_LOSS_WEIGHT = 1e3
"""Largest weight of an auxiliary loss term (z-loss, MoE losses): practical values are
1e-4 to 1e-1; the bound keeps weight * loss far below the fp32 range."""


def check_named_paths(
    field: str, tables: Sequence[Any], kind: str, path_is: str = "a prepare-data directory"
) -> None:
    """Arrays of ``{name, path}`` tables ([[data.datasets]], [[eval.sets]], [[eval.tasks]]):
    each name made of [A-Za-z0-9_-] (it becomes part of metric keys) and unique, each path
    non-empty.

    ``field`` is the array's dotted name, ``kind`` what one table is ("dataset"),
    ``path_is`` what its path names.
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
            raise ConfigError(f"{where}.path", table.path, path_is)


def _finite(value: float) -> bool:
    # math.isfinite converts to float, which fails for ints beyond the float range.
    return isinstance(value, int) or math.isfinite(value)


def _kind(*values: float) -> str:
    return "an integer" if all(isinstance(v, int) for v in values) else "a number"


def _bound(value: float) -> str:
    """A bound as users read it: 2**62 - 1 rather than 4611686018427387903, 1e+10 rather
    than 10000000000.0."""
    if isinstance(value, float) and abs(value) >= 1e7:
        return f"{value:g}"
    if isinstance(value, int) and value > 2**16:
        for offset, text in ((0, ""), (1, " - 1")):
            exponent = (value + offset).bit_length() - 1
            if value + offset == 2**exponent:
                return f"2**{exponent}{text}"
    return str(value)


def check_at_least(field: str, value: float, minimum: float, maximum: float | None = None) -> None:
    """value >= minimum and, when maximum is given, value <= maximum."""
    if not (_finite(value) and value >= minimum):
        raise ConfigError(field, value, f"{_kind(value)} >= {minimum}")
    if maximum is not None and value > maximum:
        raise ConfigError(
            field, value, f"{_kind(value, minimum)} in [{minimum}, {_bound(maximum)}]"
        )


def check_positive(field: str, value: float, maximum: float | None = None) -> None:
    """value > 0 and, when maximum is given, value <= maximum."""
    if not (_finite(value) and value > 0):
        raise ConfigError(field, value, f"{_kind(value)} > 0")
    if maximum is not None and value > maximum:
        if isinstance(value, int):
            allowed = f"an integer in [1, {_bound(maximum)}]"
        else:
            allowed = f"a number in (0, {_bound(maximum)}]"
        raise ConfigError(field, value, allowed)


def check_in_range(field: str, value: float, low: float, high: float) -> None:
    """Closed interval [low, high]."""
    if not (_finite(value) and low <= value <= high):
        raise ConfigError(
            field, value, f"{_kind(value, low, high)} in [{_bound(low)}, {_bound(high)}]"
        )


def check_choice(field: str, value: Any, choices: Iterable[Any]) -> None:
    choices = list(choices)
    if value not in choices:
        suggestion = closest_name(str(value), [str(c) for c in choices])
        hint = f"did you mean {suggestion!r}?" if suggestion else ""
        raise ConfigError(field, value, "one of " + ", ".join(map(repr, choices)), hint)
