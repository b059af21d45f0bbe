"""The failures a checkpoint step may raise, and how each is told in one line.

A failed save names a full disk as such, with the bytes still free on its file system:
torch's writer reports a short write only as "unexpected pos", so the OS error behind it
(in the exception's context) and the file system's free space are consulted.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from kempnerforge.core.errors import CheckpointError

FAILURES = (Exception, CheckpointException)
"""What a save step may raise; DCP's CheckpointException is a BaseException, not an Exception."""

FULL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
"""Out of space, or out of the user's quota: either way the disk is full for this run."""
SHORT_WRITE = "unexpected pos"
"""What torch's zip writer says when a write stopped short of the bytes it was given."""
NEARLY_FULL_BYTES = 64 * 2**20
"""Free space below which a short write with no OS error behind it is taken for a full
disk: more than any single write of a save needs, far less than a checkpoint."""


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


class FailedSave(CheckpointError):
    """A save that wrote nothing the run keeps: not committed, ``latest`` unchanged.

    Raised on every rank alike (the ranks agree that a save failed before any of them
    raises), so a caller may go on training and try again at the next save.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        step: int,
        problem: str,
        *,
        reason: str,
        bytes_free: int | None,
    ) -> None:
        super().__init__(directory, problem)
        self.step = step
        self.reason = reason
        """What went wrong, in one line (a full disk named as such)."""
        self.bytes_free = bytes_free
        """Bytes free on the checkpoint directory's file system when the disk is full."""


@dataclass(frozen=True)
class Diagnosis:
    """Why a save failed, in one line, and the bytes free when the disk is full."""

    reason: str
    bytes_free: int | None = None
    firsthand: bool = False
    """Whether this rank saw the OS error itself (its own write failed), rather than only
    hearing from DCP that some rank's write did."""


def diagnose(error: BaseException, directory: Path, os_error: OSError | None = None) -> Diagnosis:
    """Why `error` stopped a save into `directory`: its one-line description, with the OS
    error behind it when torch's writer hid it, and a full disk named as such.

    `os_error` is what this rank's own writes raised (DCP passes on only the message of
    torch's writer); otherwise the first OS error in `error`'s chain is used.
    """
    text = describe_failure(error)
    # DCP hands every rank every rank's failure: only this rank's own writes are firsthand.
    firsthand = os_error is not None
    if os_error is None:
        os_error = _os_error_within(error)
        firsthand = os_error is not None and not isinstance(error, CheckpointException)
    if os_error is not None and os_error.strerror and os_error.strerror not in text:
        text += f" ({errno.errorcode.get(os_error.errno or 0, 'OSError')}: {os_error.strerror})"
    free = bytes_free(directory)
    full = os_error is not None and os_error.errno in FULL_DISK_ERRNOS
    if os_error is None and SHORT_WRITE in text and free is not None:
        full = free < NEARLY_FULL_BYTES
    if not full:
        return Diagnosis(text, None, firsthand)
    shown = "unknown" if free is None else f"{free}"
    return Diagnosis(
        f"the disk is full: {shown} bytes free on the file system of {directory} ({text})",
        free,
        firsthand,
    )


def bytes_free(directory: Path) -> int | None:
    """Bytes an unprivileged writer may still use on `directory`'s file system (its nearest
    existing parent's), or None when the OS cannot tell."""
    path = directory
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def _os_error_within(error: BaseException) -> OSError | None:
    """The first OS error with an errno in `error`'s chain: DCP's per-rank failures, then
    each exception's cause and context (torch's RuntimeError keeps the write's OSError as
    its context)."""
    seen: set[int] = set()
    pending: list[BaseException] = [error]
    while pending:
        current = pending.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno is not None:
            return current
        if isinstance(current, CheckpointException):
            pending.extend(cause for _, (cause, _) in sorted(current.failures.items()))
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return None
