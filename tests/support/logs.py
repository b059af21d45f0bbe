"""package_records: what the kempnerforge loggers emit during a test, as LogRecords."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


class _ListHandler(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def package_records(level: int) -> Iterator[list[logging.LogRecord]]:
    """The package's records at ``level`` and above, in order, whatever configure_logging
    did before: a handler on the package logger itself sees them even when they do not
    propagate to the root logger. The logger's level is ``level`` meanwhile, then as it was."""
    handler = _ListHandler(level)
    logger = logging.getLogger("kempnerforge")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
