"""ShutdownHandler: turns stop signals into a flag the loop polls at step boundaries."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterable
from types import FrameType
from typing import Any

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class ShutdownHandler:
    """Records stop signals instead of dying, so the loop can save and exit cleanly.

    While installed, each listed signal only sets a flag and records its name: no
    exception, no exit, no I/O in the handler. A second signal (or a second Ctrl-C) while
    a stop is already pending is recorded too and does nothing else, so a checkpoint
    being written is never interrupted; use SIGKILL to force an exit. The loop polls
    `requested` and logs the stop itself. Usable as a context manager::

        with ShutdownHandler() as shutdown:
            ...  # if shutdown.requested: save, then exit with exit_codes.PREEMPTED
    """

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self._previous: dict[signal.Signals, Any] = {}
        self._received: list[str] = []
        self._reason: str | None = None
        self._vote: bool | None = None

    def install(self) -> None:
        """Catch the signals from now on, remembering the handlers they replace.

        Only the main thread may install signal handlers (a Python rule); installing
        twice is a no-op.
        """
        if self._previous:
            return
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ShutdownHandler.install() must be called from the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def uninstall(self) -> None:
        """Put back the handlers `install` replaced; the recorded stop request stays."""
        for sig, previous in self._previous.items():
            # None means a handler installed outside Python; the default is the closest.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def request(self, reason: str) -> None:
        """Ask for a stop without a signal (tests, or a stop another rank asked for)."""
        if self._reason is None:
            self._reason = reason

    def record_vote(self, stop: bool) -> None:
        """Keep the outcome of a stop vote every rank took together (inside a step).

        A stop another rank asked for becomes this rank's request too. The loop takes the
        vote at its next step boundary (take_vote) instead of holding another collective.
        """
        if stop and self._reason is None:
            self._reason = "another rank received a stop signal"
        self._vote = stop

    def take_vote(self) -> bool | None:
        """The vote recorded since the last call, or None when none was; clears it.

        A signal that arrived after the vote waits for the next one, so every rank acts on
        the same outcome.
        """
        vote, self._vote = self._vote, None
        return vote

    @property
    def requested(self) -> bool:
        """True once a signal arrived or `request` was called."""
        return self._reason is not None

    @property
    def signal_name(self) -> str | None:
        """Name of the first signal received (e.g. 'SIGTERM'), or None."""
        return self._received[0] if self._received else None

    @property
    def reason(self) -> str | None:
        """What asked for the stop: the first signal's name or `request`'s reason."""
        return self._reason

    @property
    def signals_received(self) -> tuple[str, ...]:
        """Every signal received while installed, in order (repeats included)."""
        return tuple(self._received)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Runs between bytecodes of the main thread: only record, never raise or log.
        name = signal.Signals(signum).name
        self._received.append(name)
        if self._reason is None:
            self._reason = name

    def __enter__(self) -> ShutdownHandler:
        self.install()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()
