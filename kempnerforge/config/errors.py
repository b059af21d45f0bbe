"""The one exception type for user-caused configuration problems."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration value is wrong: names the dotted field, the value and what is allowed.

    The CLI prints ``str(error)`` as a single line and exits with code 2, so the message must
    stand on its own: ``train.batch_size = 0: expected an integer >= 1``.
    """

    def __init__(self, field: str, value: Any, allowed: str, hint: str = "") -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        self.hint = hint
        message = f"{_one_line(field)} = {show_value(value)}: expected {allowed}"
        if hint:
            message += f" ({hint})"
        super().__init__(message)


_MAX_SHOWN = 300
"""Longest value repr a message shows; longer ones are cut, so the message stays one line."""


def show_value(value: Any) -> str:
    """repr(value) for a one-line message: cut to _MAX_SHOWN characters, and never failing
    (Python refuses to print integers of more than 4300 digits)."""
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"<an integer of {value.bit_length()} bits>"
        return f"<a {type(value).__name__} too large to print>"
    return text if len(text) <= _MAX_SHOWN else text[:_MAX_SHOWN] + "..."


def _one_line(text: str) -> str:
    """A field name as printable ASCII: a key quoted in TOML may hold newlines or escapes."""
    return text if text.isascii() and text.isprintable() else ascii(text)[1:-1]


def closest_name(name: str, choices: Iterable[str]) -> str | None:
    """The valid name closest to a misspelt one, or None when nothing is close."""
    matches = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_key_error(field: str, choices: Iterable[str]) -> ConfigError:
    """ConfigError for an unknown key, suggesting the closest valid key of its section."""
    choices = sorted(choices)
    key = field.rsplit(".", 1)[-1]
    suggestion = closest_name(key, choices)
    hint = f"did you mean {suggestion!r}?" if suggestion else ""
    error = ConfigError(field, key, "a known key: " + ", ".join(choices), hint)
    lead = f"{_one_line(field)}: unknown key"
    if suggestion:
        lead += f", did you mean {suggestion!r}?"
    error.args = (f"{lead} (known keys: {', '.join(choices)})",)
    return error
