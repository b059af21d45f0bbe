"""get_logger: the package's loggers, one stream handler on the 'kempnerforge' root."""

from __future__ import annotations

import logging
import sys

_ROOT = "kempnerforge"


def get_logger(name: str) -> logging.Logger:
    """A logger under the 'kempnerforge' namespace (pass __name__)."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)


def configure_logging(rank: int = 0, level: int = logging.INFO) -> None:
    """Send package logs to stderr; ranks other than 0 only report warnings and errors.

    Called once by the CLI. Library code never configures logging itself.
    """
    root = logging.getLogger(_ROOT)
    for handler in list(root.handlers):
        root.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[rank {rank}] " if rank else ""
    handler.setFormatter(logging.Formatter(f"{prefix}%(levelname)s %(name)s: %(message)s"))
    root.addHandler(handler)
    root.setLevel(level if rank == 0 else logging.WARNING)
    root.propagate = False
