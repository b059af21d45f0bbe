"""The console side of a run's metrics: log lines, and a live progress bar kept below them."""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from typing import IO, Any

from kempnerforge.core.logging import get_live_line, set_live_line

BAR_REDRAW_S = 0.1  # the bar redraws at most this often (log lines always redraw it)
_CLEAR_TO_EOL = "\x1b[K"


class Console:
    """Log lines, and in bar mode one live line kept below them.

    Registered as the live line while it lives, so log records from other modules clear
    the bar first and redraw it after (see configure_logging).
    """

    def __init__(self, stream: IO[str], *, bar: bool) -> None:
        self._stream = stream
        self._bar = bar
        self._width = shutil.get_terminal_size((100, 24)).columns - 1
        self._text = ""  # the bar's current text; "" before the first step
        self._visible = False
        self._drawn_at = -math.inf
        self._lock = threading.Lock()  # log records may come from other threads
        if bar:
            set_live_line(self)

    def line(self, text: str, bar_text: str) -> None:
        """Print one log line; in bar mode above the (redrawn) bar."""
        with self._lock:
            if not self._bar:
                self._stream.write(text + "\n")
            else:
                self._stream.write("\r" + text + _CLEAR_TO_EOL + "\n")
                self._visible = False
                self._set_and_draw(bar_text)
            self._stream.flush()

    def bar_due(self, now: float) -> bool:
        return self._bar and now - self._drawn_at >= BAR_REDRAW_S

    def draw_bar(self, bar_text: str) -> None:
        if not self._bar:
            return
        with self._lock:
            self._set_and_draw(bar_text)
            self._stream.flush()

    def _set_and_draw(self, bar_text: str) -> None:
        self._text = bar_text[: self._width]
        if self._text:
            self._stream.write("\r" + self._text + _CLEAR_TO_EOL)
            self._visible = True
            self._drawn_at = time.perf_counter()

    def clear(self) -> None:
        """Erase the bar (before someone else prints a line)."""
        with self._lock:
            if self._visible:
                self._stream.write("\r" + _CLEAR_TO_EOL)
                self._stream.flush()
                self._visible = False

    def redraw(self) -> None:
        """Draw the bar again after a foreign line."""
        with self._lock:
            if self._bar and not self._visible and self._text:
                self._stream.write("\r" + self._text + _CLEAR_TO_EOL)
                self._stream.flush()
                self._visible = True

    def close(self) -> None:
        """Leave the bar's last state on its own line."""
        with self._lock:
            if self._visible:
                self._stream.write("\n")
                self._stream.flush()
                self._visible = False
            self._bar = False
        if get_live_line() is self:
            set_live_line(None)


def resolve_progress(progress: str, stream: IO[str]) -> str:
    """'auto' becomes 'bar' on an interactive terminal, else 'plain'."""
    if progress != "auto":
        return progress
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        tty = False
    return "bar" if tty and os.environ.get("TERM") != "dumb" else "plain"


def fmt(value: Any, spec: str = "") -> str:
    """A console figure: `spec` for finite numbers, 'nan'/'inf' as such, '-' for None."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        if not spec:
            spec = ".4f" if 1e-3 <= abs(value) < 1e5 or value == 0 else ".3e"
    return format(value, spec)


def duration(seconds: float) -> str:
    """6m40s-style duration for the ETA."""
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
