"""Loss-masked test corpora: documents given with a mask, written with TokenFileWriter."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kempnerforge.data.token_file import TokenFileWriter
from kempnerforge.data.tokenizer import ByteTokenizer, Tokenizer

MaskedDocument = tuple[Sequence[int], Sequence[bool]]
"""One document's ids and, per id, whether it is a supervised target."""


def write_masked_dir(
    path: Path | str,
    documents: Sequence[MaskedDocument],
    tokenizer: Tokenizer | None = None,
    bos_per_document: bool = False,
) -> str:
    """A masked prepared directory (a local path or a store URL) of exactly these documents."""
    with TokenFileWriter(str(path), tokenizer or ByteTokenizer(), bos_per_document) as writer:
        for ids, mask in documents:
            writer.add_document(np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=bool))
        writer.finish(num_sources=1)
    return str(path)


def turns(*parts: tuple[Sequence[int], bool]) -> MaskedDocument:
    """A document of turns, each (ids, whether the assistant says them)."""
    ids = [i for part, _ in parts for i in part]
    mask = [on for part, on in parts for _ in part]
    return ids, mask
