"""RunLock: one training run per directory, enforced with an exclusive flock.

A run locks its run directory and its checkpoint directory. The lock belongs to the
process that took it: forked children (dataloader workers) do not keep it, so a killed
run's orphaned workers never block the requeue that follows.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

LOCK_NAME = ".lock"
_READ_TRIES = 3  # the holder writes its record right after locking: give it a moment

# Descriptors of the locks this process holds, closed in every forked child: a flock
# belongs to the open file, which fork shares, so a child left holding the descriptor
# would keep the lock alive after this process dies.
_held_fds: set[int] = set()


def _close_inherited_locks() -> None:
    for fd in list(_held_fds):
        with contextlib.suppress(OSError):
            os.close(fd)  # the child's copy only: the parent's lock stays held
    _held_fds.clear()


os.register_at_fork(after_in_child=_close_inherited_locks)


class RunLockError(Exception):
    """Another live process holds the directory; the message names it."""

    def __init__(
        self,
        run_dir: str,
        holder: dict[str, Any] | None,
        what: str = "run directory",
        field: str = "train.run_dir",
    ) -> None:
        self.run_dir = run_dir
        self.holder = holder
        super().__init__(
            f"{what} {run_dir} is in use by {_describe(holder)}; "
            f"stop that run or choose another {field}"
        )


class RunLock:
    """Holds `<directory>/.lock` so two runs never write the same checkpoints and metrics.

    `acquire` takes an exclusive, non-blocking ``fcntl.flock`` on the file and writes the
    holder's pid, hostname and start time into it; a second run on the same directory gets
    a `RunLockError` naming that holder. The kernel drops the lock when its process exits,
    however it exits, so a file left behind by a killed run is free: it is taken over with
    a warning naming the old pid. The flock itself is the authority, not the recorded pid,
    which another process may have been given since (after a reboot, say).

    Only rank 0 should take it (the caller decides): ranks on other nodes sharing the
    directory would otherwise lock each other out. Across nodes the filesystem must honour
    flock (NFS and Lustre mounted with ``flock`` do; Lustre's ``localflock`` only guards one
    node). Forked children (dataloader workers) close their copy of the descriptor at once,
    so the lock dies with the process that took it, not with its last child. ``what`` and
    ``field`` name the directory in the error ("checkpoint directory", "checkpoint.dir").
    Usable as a context manager::

        with RunLock(config.run_dir):
            ...  # train
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        what: str = "run directory",
        field: str = "train.run_dir",
    ) -> None:
        self.run_dir = str(run_dir)
        self.path = Path(run_dir) / LOCK_NAME
        self.what = what
        self.field = field
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """True between a successful `acquire` and `release`."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise `RunLockError`; creates the run directory if needed.

        Acquiring a lock this object already holds is a no-op.
        """
        if self._fd is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_record(fd, retries=_READ_TRIES)
            os.close(fd)
            raise RunLockError(self.run_dir, holder, self.what, self.field) from None
        except OSError as e:
            os.close(fd)
            # e.g. ENOLCK on an NFS mount without lock support: say which file and why.
            raise OSError(
                e.errno,
                f"cannot lock {self.path}: {e.strerror} (does the filesystem support flock?)",
            ) from e
        try:
            previous = _read_record(fd, retries=1)
            if previous is not None:
                logger.warning(
                    "taking over the stale lock %s left by %s: %s",
                    self.path,
                    _describe(previous),
                    _why_stale(previous),
                )
            _write_record(fd, _this_process())
        except OSError as e:
            os.close(fd)  # closing drops the flock too
            # pwrite on a full disk names no file: say which one.
            raise OSError(e.errno, e.strerror, str(self.path)) from e
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        _held_fds.add(fd)

    def release(self) -> None:
        """Clear the record and drop the lock; a no-op when not held."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _held_fds.discard(fd)
        try:
            # Truncate, never unlink: a waiter may already have the file open, and unlinking
            # would let it lock an orphaned inode while a third run creates a fresh one.
            os.ftruncate(fd, 0)
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _this_process() -> dict[str, Any]:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": started}


def _write_record(fd: int, record: dict[str, Any]) -> None:
    data = (json.dumps(record) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)


def _read_record(fd: int, retries: int) -> dict[str, Any] | None:
    """The holder record in the file, or None when it is empty or unreadable."""
    for attempt in range(retries):
        if attempt:
            time.sleep(0.05)
        raw = os.pread(fd, 4096, 0)
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            continue
        if isinstance(record, dict) and "pid" in record:
            return record
    return None


def _describe(record: dict[str, Any] | None) -> str:
    if record is None:
        return "another process (it has not recorded its pid yet)"
    return (
        f"pid {record.get('pid')} on {record.get('host', 'an unknown host')} "
        f"(started {record.get('started', 'at an unknown time')})"
    )


def _why_stale(record: dict[str, Any]) -> str:
    if record.get("host") != socket.gethostname():
        return "it no longer holds the lock (it exited, or its node went down)"
    if _pid_alive(record.get("pid")):
        return "it no longer holds the lock (that pid now belongs to another process)"
    return "that process has exited"


def _pid_alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
