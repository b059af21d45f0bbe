"""get_logger: the package's loggers, one stream handler on the 'kempnerforge' root."""

from __future__ import annotations

import logging
import sys
from typing import Protocol

_ROOT = "kempnerforge"


class LiveLine(Protocol):
    """A console line redrawn in place (the progress bar) that log records must not break."""

    def clear(self) -> None: ...

    def redraw(self) -> None: ...


_live_line: LiveLine | None = None


def set_live_line(line: LiveLine | None) -> None:
    """Register the console's live line (None removes it) so log records print above it."""
    global _live_line
    _live_line = line


def get_live_line() -> LiveLine | None:
    """The registered live line, if any."""
    return _live_line


class _LiveLineSafeHandler(logging.StreamHandler):
    """A StreamHandler that clears the live line before a record and redraws it after."""

    def emit(self, record: logging.LogRecord) -> None:
        line = _live_line
        if line is None:
            super().emit(record)
            return
        line.clear()
        try:
            super().emit(record)
        finally:
            line.redraw()


def get_logger(name: str) -> logging.Logger:
    """A logger under the 'kempnerforge' namespace (pass __name__)."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def configure_logging(rank: int = 0, level: int = logging.INFO) -> None:
    """Send package logs to stderr; ranks other than 0 only report warnings and errors.

    Called once by the CLI. Library code never configures logging itself. A record printed
    while a progress bar is live lands on its own line and the bar is redrawn below it.
    """
    root = logging.getLogger(_ROOT)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = _LiveLineSafeHandler(sys.stderr)
    prefix = f"[rank {rank}] " if rank else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False
