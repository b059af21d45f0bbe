"""Preparing corpora (prepare-data): reading raw text and conversation inputs, tokenizing them
in worker processes, and writing a prepared directory, whole or as shards.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.data.prepare.corpus import prepare_data, write_corpus
from kempnerforge.data.prepare.formats import INPUT_FORMATS, InputFormat, check_format_options
from kempnerforge.data.prepare.sources import SUPPORTED

__all__ = [
    "INPUT_FORMATS",
    "SUPPORTED",
    "InputFormat",
    "check_format_options",
    "prepare_data",
    "write_corpus",
]
