"""DataError: the one exception for user-caused problems with data files."""

from __future__ import annotations

from kempnerforge.config.errors import ConfigError


class DataError(Exception):
    """A data file is missing, malformed or does not fit this job.

    The message names the file, says what is wrong with it and what to do, and stands on its
    own: the CLI prints ``str(error)`` as one line and exits with code 2, no traceback.
    """


class DataPathError(ConfigError, DataError):
    """A directory named by a config field does not hold data this job can use.

    Both kinds at once: a ConfigError whose ``field`` is the config field that points at the
    directory (startup validation catches it like any bad value), and a DataError whose one
    line is the field followed by what is wrong with the file.
    """

    def __init__(self, field: str, path: str, problem: DataError) -> None:
        super().__init__(field, path, "a prepare-data directory this job can read", str(problem))
        self.args = (f"{field}: {problem}",)


WORKER_PREFIX = "Caught DataError in DataLoader worker"


def unwrap_worker_error(error: DataError) -> DataError:
    """The DataError a dataloader worker raised, with its own one-line message.

    A worker's exception reaches the training process re-created from its formatted
    traceback ("Caught DataError in DataLoader worker process 0. Original Traceback ...");
    the message a user needs is the traceback's last line. Errors raised in the training
    process itself come back unchanged.
    """
    text = str(error)
    if not text.startswith(WORKER_PREFIX):
        return error
    marker = f"{DataError.__module__}.{DataError.__name__}: "
    last = text.rstrip().rsplit(marker, 1)
    return DataError(last[1]) if len(last) == 2 else error
