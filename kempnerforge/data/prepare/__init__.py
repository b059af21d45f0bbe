"""Preparing corpora (prepare-data): reading raw text, conversation, preference and prompt
inputs, tokenizing them in worker processes, and writing a prepared directory, whole or as
shards.

Modules outside this folder import these names from here, never from its modules. The corpus
writers (prepare_data, write_corpus, write_preference_corpus, write_prompts_corpus) are
imported on first use: they bring numpy, the tokenizers and chat rendering, and the command
line's parser, which reads only the formats table, must build without them (`kempnerforge
--help` imports neither numpy nor torch).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kempnerforge.data.prepare.formats import INPUT_FORMATS, InputFormat, check_format_options
from kempnerforge.data.prepare.sources import SUPPORTED

if TYPE_CHECKING:
    from kempnerforge.data.prepare.corpus import prepare_data, write_corpus
    from kempnerforge.data.prepare.preference import write_preference_corpus
    from kempnerforge.data.prepare.prompts import write_prompts_corpus

_CORPUS_NAMES = ("prepare_data", "write_corpus")


def __getattr__(name: str) -> Any:
    if name in _CORPUS_NAMES:
        from kempnerforge.data.prepare import corpus

        return getattr(corpus, name)
    if name == "write_preference_corpus":
        from kempnerforge.data.prepare import preference

        return preference.write_preference_corpus
    if name == "write_prompts_corpus":
        from kempnerforge.data.prepare import prompts

        return prompts.write_prompts_corpus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "INPUT_FORMATS",
    "SUPPORTED",
    "InputFormat",
    "check_format_options",
    "prepare_data",
    "write_corpus",
    "write_preference_corpus",
    "write_prompts_corpus",
]
