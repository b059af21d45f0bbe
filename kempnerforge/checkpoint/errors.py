"""CheckpointError: what the CLI reports when a checkpoint cannot be saved, found or loaded.

Imports nothing heavy: the CLI imports it at startup and must answer ``--help`` at once.
"""

from __future__ import annotations

import os


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
