"""prepare-data --format preference: .jsonl (optionally .gz) rows of a prompt and a chosen and
a rejected response, each response rendered after the prompt with the tokenizer's chat
template (as --format chat renders a prompt and completion) and written as one window of
--seq-len tokens: pair i is windows 2i (chosen) and 2i + 1 (rejected), each padded to the
window, its response's tokens the only targets (token_flags.bin). The pair sampler
(data/sampling/pairs.py) keeps a pair's two windows in one micro-batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat import (
    ChatTemplate,
    Conversation,
    ConversationRefused,
    conversation_of,
    encode_conversations,
)
from kempnerforge.data.prepare.chat_sources import jsonl_records
from kempnerforge.data.prepare.sources import discover_input_files, input_kind
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.data.tokens import TokenFileWriter

PREFERENCE_FORMAT = "preference"
"""meta.json's ``format`` of a preference corpus."""
PAIR_FIELDS = ("prompt", "chosen", "rejected")


@dataclass
class PairCounts:
    """What preparing a preference corpus did with its pairs (meta.json's fields)."""

    pairs: int = 0
    pairs_cut: int = 0
    """Pairs with a response cut to its window's first --seq-len tokens."""
    pairs_dropped: int = 0
    """Pairs left out: longer than a window with --long-conversations drop, or cut to no
    response token."""
    pairs_refused: int = 0
    """Pairs the chat template refused (skipped, or the first stops with --stop-on-refused)."""
    pad_tokens: int = 0


def read_pairs(path: Path) -> Iterator[tuple[Conversation, Conversation]]:
    """The (chosen, rejected) conversations of each row of a .jsonl file, in order: the
    prompt followed by each response, as conversation_of reads a prompt and completion
    (two strings, or two lists of messages)."""
    if input_kind(path) != "jsonl":
        raise DataError(
            f"{path}: --format preference reads .jsonl files (optionally .gz), one pair a line "
            "with 'prompt', 'chosen' and 'rejected'"
        )
    for where, record in jsonl_records(path):
        missing = [f for f in PAIR_FIELDS if not isinstance(record, dict) or f not in record]
        if missing:
            raise DataError(
                f"{where}: a preference row needs 'prompt', 'chosen' and 'rejected'; "
                f"missing {', '.join(missing)}"
            )
        yield tuple(  # type: ignore[misc]
            conversation_of({"prompt": record["prompt"], "completion": record[side]}, where)
            for side in ("chosen", "rejected")
        )


Fitted = tuple[np.ndarray, np.ndarray]


def _fit(encoded: Fitted, seq_len: int, cut: bool) -> Fitted | None:
    """The response fitted to a window: as it is, its first ``seq_len`` tokens (with
    ``cut`` and a target left after the first token), or None (left out)."""
    tokens, mask = encoded
    if len(tokens) <= seq_len:
        return tokens, mask
    if not cut or not mask[1:seq_len].any():
        return None
    return tokens[:seq_len], mask[:seq_len]


def _fit_pair(
    encoded: list[Any], seq_len: int, cut: bool, counts: PairCounts
) -> list[Fitted] | None:
    """Both responses fitted to their windows, counting a cut or dropped pair; None when
    the pair is left out."""
    fitted = [_fit(e, seq_len, cut) for e in encoded]
    kept = [f for f in fitted if f is not None]
    if len(kept) < len(fitted):
        counts.pairs_dropped += 1
        return None
    counts.pairs_cut += any(len(f[0]) < len(e[0]) for f, e in zip(kept, encoded, strict=True))
    return kept


def write_preference_corpus(
    inputs: list[str],
    output_dir: str,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    seq_len: int,
    *,
    long_conversations: str = "cut",
    stop_on_refused: bool = False,
) -> dict[str, Any]:
    """Write the pairs of ``inputs`` to ``output_dir``; returns the meta.json written.

    One process, no held-out split and no shards (a preference set is small next to a
    pretraining corpus). A DataError names the file and line of a bad row.
    """
    files = discover_input_files(inputs)
    counts = PairCounts()
    with TokenFileWriter(output_dir, tokenizer, masked=True) as writer:
        for path in files:
            for chosen, rejected in read_pairs(path):
                encoded = encode_conversations(tokenizer, template, [chosen, rejected])
                refused = next((e for e in encoded if isinstance(e, ConversationRefused)), None)
                if refused is not None:
                    if stop_on_refused:
                        raise DataError(f"{chosen.where}: {refused}")
                    counts.pairs_refused += 1
                    continue
                fitted = _fit_pair(encoded, seq_len, long_conversations == "cut", counts)
                for tokens, mask in fitted or []:
                    writer.add_document(tokens, mask)
                    if len(tokens) < seq_len:
                        writer.add_padding(seq_len - len(tokens))
                        counts.pad_tokens += seq_len - len(tokens)
                counts.pairs += fitted is not None
        if counts.pairs == 0:
            raise DataError(
                f"{output_dir}: no pair to write ({counts.pairs_dropped} dropped as longer than "
                f"--seq-len {seq_len}, {counts.pairs_refused} refused by the chat template)"
            )
        writer.add_padding(1)  # the last window's (N + 1)-th token
        counts.pad_tokens += 1
        return writer.finish(
            len(files),
            {"format": PREFERENCE_FORMAT, "packed_seq_len": seq_len, **vars(counts)},
        )
