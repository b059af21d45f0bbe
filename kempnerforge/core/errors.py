"""The exceptions a user-caused problem raises: a config value, a data file, a checkpoint,
another rank. Each message stands on its own as one line; the CLI prints it and exits with
the code the kind calls for (kempnerforge/resilience/exit_codes.py). Imports nothing heavy:
the CLI imports this at startup and must answer ``--help`` at once."""

from __future__ import annotations

import difflib
import os
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


class DataError(Exception):
    """A data file is missing, malformed or does not fit this job.

    The message names the file, says what is wrong with it and what to do, and stands on its
    own: the CLI prints ``str(error)`` as one line and exits with code 2, no traceback.
    """


class DataPathError(ConfigError, DataError):
    """A directory named by a config field does not hold data this job can use.

    Both kinds at once: a ConfigError whose ``field`` is the config field that points at the
    directory (startup validation catches it like any bad value), and a DataError whose one
    line is the field followed by what is wrong with the file.
    """

    def __init__(self, field: str, path: str, problem: DataError) -> None:
        super().__init__(field, path, "a prepare-data directory this job can read", str(problem))
        self.args = (f"{field}: {problem}",)


WORKER_PREFIX = "Caught DataError in DataLoader worker"


def unwrap_worker_error(error: DataError) -> DataError:
    """The DataError a dataloader worker raised, with its own one-line message.

    A worker's exception reaches the training process re-created from its formatted
    traceback ("Caught DataError in DataLoader worker process 0. Original Traceback ...");
    the message a user needs is the traceback's last line. Errors raised in the training
    process itself come back unchanged.
    """
    text = str(error)
    if not text.startswith(WORKER_PREFIX):
        return error
    marker = f"{DataError.__module__}.{DataError.__name__}: "
    last = text.rstrip().rsplit(marker, 1)
    return DataError(last[1]) if len(last) == 2 else error


class CheckpointError(Exception):
    """A checkpoint cannot be saved, found or loaded; names the path and what is wrong."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")

    def __reduce__(self) -> tuple[type[CheckpointError], tuple[str, str]]:
        # DCP sends a rank's exception to the others pickled; rebuild from both fields.
        return (type(self), (self.path, self.problem))


def incomplete(path: str | os.PathLike[str], problems: list[str]) -> CheckpointError:
    """The error for a checkpoint that is not complete: its path and what is wrong."""
    return CheckpointError(path, "not a complete checkpoint: " + "; ".join(problems))


class PeerSetupError(Exception):
    """Rank 0 could not take the run's directories (a refused directory, a held lock); the
    other ranks stop with its reason instead of waiting for it."""


class CollectiveFailure(Exception):
    """A collective failed because a peer died or hung; the message names the collective,
    this rank and the unresponsive ranks (see kempnerforge.distributed.failure)."""


class HardwareFaultError(Exception):
    """Too many faults that did not repeat when their step was run again: the machine is
    suspect. The CLI exits with HARDWARE_FAULT (76), so the job can be moved elsewhere."""

    def __init__(self, count: int, limit: int, step: int, where: str) -> None:
        self.count = count
        self.step = step
        super().__init__(
            f"{count} suspected hardware faults in this launch (train.max_hardware_faults = "
            f"{limit}), the last at step {step} on {where}: each time a step whose loss or "
            "gradient norm was non-finite or spiking came out clean when run again on the same "
            "weights and batches; requeue the job on other nodes (scripts/slurm/train.sbatch "
            "excludes the hosts named) and it resumes from its last checkpoint"
        )
