"""The hang watchdog: a training step, an eval or a checkpoint save or load that runs past
its limit writes every thread's stack to ``run_dir/hangs/`` and ends the process with
exit code HANG (77).

A hung collective cannot be unwound from Python, so the watchdog is a daemon thread of
its own, started once per run. The loop marks what it is doing with ``watch(kind, step)``
(a lock, a list append and, only when the thread must wake sooner, a notify: no thread, no
collective, no host sync per step). Every rank runs its own watchdog, so every rank that
can still run Python writes its stacks: the one that hangs, and the ones waiting for it
in a collective.

The limit of each kind of work (train.hang_timeout_s):

- 0 (the default), derived from measured times: the first two of each kind (compile,
  warm-up, the first save's allocation) get START_S; from then on a kind's limit is
  FACTOR times the slowest of it seen so far (the first not counted), and at least
  FLOOR_S;
- a positive value is a step's limit; an eval and a checkpoint save or load get the
  larger of it and their derived limit, as they may take far longer than a step;
- a negative value turns the watchdog off.

A kind may be given a floor (``at_least``): a checkpoint into an object store may wait for
the store up to its own deadlines (checkpoint.store_timeout_s each), and a store that
stalls must fail the save, as documented, before the watchdog ends the run.

Time spent inside a nested watch (an eval or a save inside a step) is not the outer
step's: the outer limit starts again when the inner one ends.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from kempnerforge.core.logging import get_logger
from kempnerforge.resilience.exit_codes import HANG

logger = get_logger(__name__)

HANGS_DIR = "hangs"
START_S = 1800.0
"""The limit of the first two of each kind: torch.compile, first-touch allocation and the
first save's staging buffers take far longer than what follows."""
FACTOR = 10.0
"""A kind's limit is this many times its slowest time seen."""
FLOOR_S = 300.0
"""No derived limit is shorter: a step of a few ms must not be killed by a slow disk's
hiccup or a page-cache flush."""
GRACE_MAX_S = 30.0
"""The most a rank whose watchdog fired waits before it exits (see HangWatchdog)."""
GRACE_STEPS = 3.0
"""Once steps have been timed, the grace is this many of the slowest step, ..."""
GRACE_MIN_S = 3.0
"""... and at least this long."""
STEP, EVAL, CHECKPOINT = "step", "eval", "checkpoint"
_UNCOUNTED = 1
"""Leading times of each kind left out of the slowest-seen rule (warm-up)."""


@dataclass
class _Frame:
    kind: str
    step: int
    limit_s: float
    started: float
    """time.monotonic() when the work began."""
    resumed: float
    """When its limit last started to run: at the start, or when a nested watch ended."""
    nested_s: float = 0.0
    """Time spent inside nested watches, which is not this work's own."""


class HangWatchdog:
    """Ends a rank whose current work runs past its limit, with its stacks on disk.

    Used as a context manager around training: entering starts the thread and makes this
    the watchdog ``watch`` reports to; leaving stops it. When it fires it appends a
    one-line summary and every thread's stack to ``run_dir/hangs/rank<R>-<host>.txt``,
    logs the same line, calls ``on_exit(HANG)`` (the CLI records the exit code there),
    flushes the logs and, after a grace period (grace_s), ends the process with
    ``os._exit(HANG)``. The grace lets the other ranks' watchdogs, which fire within about
    a step of each other, dump their stacks while their collectives still wait, rather than
    fail first as the hung rank disappears. A rank that meanwhile
    leaves the context with an error (its collective failed) waits there for that exit.
    """

    def __init__(
        self,
        timeout_s: float,
        run_dir: str | os.PathLike[str],
        rank: int = 0,
        *,
        on_exit: Callable[[int], None] | None = None,
        at_least: Mapping[str, float] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.at_least = dict(at_least or {})
        """The lowest limit of each kind named, whatever the rules above give."""
        self.path = Path(run_dir) / HANGS_DIR / f"rank{rank}-{socket.gethostname()}.txt"
        self.rank = rank
        self.on_exit = on_exit
        self.fired = False
        self._frames: list[_Frame] = []
        self._seen: dict[str, tuple[int, float]] = {}
        """Per kind: how many have ended, and the slowest of those counted."""
        self._wake_at: float | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def enabled(self) -> bool:
        return self.timeout_s >= 0

    def limit_s(self, kind: str) -> float:
        """The limit the next `kind` of work gets (see the module docstring)."""
        seen, slowest = self._seen.get(kind, (0, 0.0))
        derived = max(FLOOR_S, FACTOR * slowest) if seen > _UNCOUNTED else START_S
        if self.timeout_s > 0:
            derived = self.timeout_s if kind == STEP else max(self.timeout_s, derived)
        return max(derived, self.at_least.get(kind, 0.0))

    def grace_s(self, limit_s: float) -> float:
        """How long a rank whose work of limit ``limit_s`` ran past it waits before exiting:
        GRACE_STEPS of the slowest step seen (the ranks' steps start together, so their
        watchdogs fire within about a step of each other), at least GRACE_MIN_S; before any
        step was timed, the limit itself. Never more than the limit or GRACE_MAX_S."""
        seen, slowest = self._seen.get(STEP, (0, 0.0))
        grace = max(GRACE_MIN_S, GRACE_STEPS * slowest) if seen > _UNCOUNTED else limit_s
        return min(grace, limit_s, GRACE_MAX_S)

    @contextlib.contextmanager
    def watch(self, kind: str, step: int) -> Iterator[None]:
        """Mark `kind` of work for `step` as running for the block; see the module docstring."""
        now = time.monotonic()
        frame = _Frame(kind, step, self.limit_s(kind), now, now)
        with self._cond:
            self._frames.append(frame)
            self._wake_if_sooner(now + frame.limit_s)
        try:
            yield
        finally:
            self._end(frame)

    def _end(self, frame: _Frame) -> None:
        now = time.monotonic()
        with self._cond:
            self._frames.remove(frame)
            own = now - frame.started - frame.nested_s
            seen, slowest = self._seen.get(frame.kind, (0, 0.0))
            if seen >= _UNCOUNTED:
                slowest = max(slowest, own)
            self._seen[frame.kind] = (seen + 1, slowest)
            if self._frames:
                outer = self._frames[-1]
                outer.nested_s += now - frame.started
                outer.resumed = now  # its limit runs again from here
            # No notify: a thread waiting for a later deadline finds this when it wakes.

    def _wake_if_sooner(self, deadline: float) -> None:
        if self._wake_at is None or deadline < self._wake_at:
            self._cond.notify()

    def __enter__(self) -> HangWatchdog:
        global _current
        if self.enabled:
            self._thread = threading.Thread(
                target=self._run, name="kempnerforge-hang-watchdog", daemon=True
            )
            self._thread.start()
            _current = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _current
        if _current is self:
            _current = None
        if self.fired:
            # The process is ending with HANG: an error this hang caused must not end it first.
            while True:
                time.sleep(60)
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                frame = self._frames[-1] if self._frames else None
                if frame is None:
                    self._wake_at = None
                    self._cond.wait()
                    continue
                deadline = frame.resumed + frame.limit_s
                now = time.monotonic()
                if now >= deadline:
                    break
                self._wake_at = deadline
                self._cond.wait(deadline - now)
            else:
                return
        self._fire(frame, now)

    def _fire(self, frame: _Frame, now: float) -> None:
        self.fired = True
        summary = (
            f"rank {self.rank} on {socket.gethostname()}: {frame.kind} {frame.step} has run "
            f"{now - frame.resumed:.1f} s, past its limit of {frame.limit_s:.1f} s "
            f"(train.hang_timeout_s = {self.timeout_s:g}); every thread's stack follows, "
            f"and the run exits with code {HANG}"
        )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())} {summary}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
                f.write("\n")
            logger.critical("hang: %s (written to %s)", summary, self.path)
        except OSError as e:  # a full or gone disk: the stacks go to stderr instead
            logger.critical("hang: %s (cannot write %s: %s)", summary, self.path, e)
            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        if self.on_exit is not None:
            with contextlib.suppress(Exception):
                self.on_exit(HANG)
        _flush_logs()
        time.sleep(self.grace_s(frame.limit_s))
        _flush_logs()
        os._exit(HANG)


def _flush_logs() -> None:
    for handler in logging.getLogger("kempnerforge").handlers + logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


_current: HangWatchdog | None = None


def watch(kind: str, step: int) -> contextlib.AbstractContextManager[None]:
    """Mark `kind` of work ('step', 'eval', 'checkpoint') for `step` as running for the
    block, under the watchdog in force (nothing when none is, as in a test's own loop)."""
    watchdog = _current
    return contextlib.nullcontext() if watchdog is None else watchdog.watch(kind, step)
