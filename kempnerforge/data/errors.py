"""DataError: the one exception for user-caused problems with data files."""

from __future__ import annotations


class DataError(Exception):
    """A data file is missing, malformed or does not fit this job.

    The message names the file, says what is wrong with it and what to do, and stands on its
    own: the CLI prints ``str(error)`` as one line and exits with code 2, no traceback.
    """
