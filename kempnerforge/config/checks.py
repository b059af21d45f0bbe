"""Tiny validation helpers shared by the section dataclasses."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from kempnerforge.config.errors import ConfigError, closest_name


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
