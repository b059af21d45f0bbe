"""CheckpointError, and the failures a save step may raise."""

from __future__ import annotations

import os

from torch.distributed.checkpoint.api import CheckpointException

FAILURES = (Exception, CheckpointException)
"""What a save step may raise; DCP's CheckpointException is a BaseException, not an Exception."""


class CheckpointError(Exception):
    """A checkpoint cannot be saved, found or loaded; names the path and what is wrong."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def describe_failure(error: BaseException) -> str:
    """`error` in one line; DCP's multi-line CheckpointException becomes its first cause."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"
