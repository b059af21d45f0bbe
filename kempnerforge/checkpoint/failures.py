"""The failures a checkpoint step may raise, and how each is told in one line."""

from __future__ import annotations

from torch.distributed.checkpoint.api import CheckpointException

from kempnerforge.core.errors import CheckpointError

FAILURES = (Exception, CheckpointException)
"""What a save step may raise; DCP's CheckpointException is a BaseException, not an Exception."""


def first_cause(error: BaseException) -> BaseException:
    """The lowest rank's exception inside DCP's CheckpointException, else `error` itself."""
    if isinstance(error, CheckpointException) and error.failures:
        _, (cause, _) = min(error.failures.items(), key=lambda item: item[0])
        return cause
    return error


def describe_failure(error: BaseException) -> str:
    """`error` in one line; DCP's multi-line CheckpointException becomes its first cause."""
    if isinstance(error, CheckpointException) and error.failures:
        rank = min(error.failures)
        cause = first_cause(error)
        return f"rank {rank}: {type(cause).__name__}: {cause}"
    if isinstance(error, CheckpointError):
        return str(error)
    return f"{type(error).__name__}: {error}"
