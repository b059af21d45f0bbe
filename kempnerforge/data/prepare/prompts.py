"""prepare-data --format prompts: .jsonl (optionally .gz) rows of a prompt and the reference
answer a reward checks, each written as one window of --seq-len tokens: the prompt rendered
with the tokenizer's chat template and the assistant's turn opened (as `generate --chat`
renders it), never a target, then the answer's plain tokens, the window's only targets
(token_flags.bin), then padding. A sample's labels are thus the answer, and the positions
before its first target are the prompt a policy generates from."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat import ChatTemplate, check_messages, encode_with_offsets
from kempnerforge.data.prepare.chat_sources import jsonl_records
from kempnerforge.data.prepare.sources import discover_input_files, input_kind
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.data.tokens import TokenFileWriter

PROMPTS_FORMAT = "prompts"
"""meta.json's ``format`` of a prompts corpus."""
PROMPT_FIELDS = ("prompt", "answer")


@dataclass
class PromptCounts:
    """What preparing a prompts corpus did with its rows (meta.json's fields)."""

    prompts: int = 0
    prompts_dropped: int = 0
    """Rows left out because the prompt and its answer do not fit a window: neither is cut,
    since a cut prompt asks another question and a cut answer is not the one rewarded."""
    prompts_refused: int = 0
    """Rows the chat template refused (skipped, or the first stops with --stop-on-refused)."""
    pad_tokens: int = 0


@dataclass(frozen=True)
class PromptRow:
    """One row: the prompt's messages and the reference answer, with where it came from."""

    messages: list[dict[str, Any]]
    answer: str
    where: str


def read_prompts(path: Path) -> Iterator[PromptRow]:
    """The rows of a .jsonl file, in order: a string prompt is one user message, a list is
    checked as a conversation's messages; the answer is a non-empty string."""
    if input_kind(path) != "jsonl":
        raise DataError(
            f"{path}: --format prompts reads .jsonl files (optionally .gz), one row a line "
            "with 'prompt' and 'answer'"
        )
    for where, record in jsonl_records(path):
        missing = [f for f in PROMPT_FIELDS if not isinstance(record, dict) or f not in record]
        if missing:
            raise DataError(
                f"{where}: a prompts row needs 'prompt' and 'answer'; missing {', '.join(missing)}"
            )
        prompt, answer = record["prompt"], record["answer"]
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, list):
            messages = check_messages(prompt, f"{where}: prompt")
        else:
            raise DataError(
                f"{where}: 'prompt' is {type(prompt).__name__}; expected a string (one user "
                "turn) or a list of messages"
            )
        if not isinstance(answer, str) or not answer.strip():
            found = type(answer).__name__ if not isinstance(answer, str) else "an empty string"
            raise DataError(
                f"{where}: 'answer' is {found}; expected the reference answer's text, which "
                'the reward checks (e.g. "42")'
            )
        yield PromptRow(messages, answer, where)


def encode_prompt_row(
    tokenizer: Tokenizer, rendered_prompt: str, answer: str
) -> tuple[np.ndarray, np.ndarray]:
    """The row's tokens and loss mask: the rendered prompt tokenized whole, without added
    special tokens, as `generate --chat` tokenizes it (mask off), then the answer tokenized
    as plain text (mask on)."""
    prompt_ids = encode_with_offsets(tokenizer, rendered_prompt)[0]
    answer_ids = encode_with_offsets(tokenizer, answer)[0]
    tokens = np.concatenate([prompt_ids, answer_ids]).astype(np.int64)
    mask = np.concatenate([np.zeros(len(prompt_ids), bool), np.ones(len(answer_ids), bool)])
    return tokens, mask


def write_prompts_corpus(
    inputs: list[str],
    output_dir: str,
    tokenizer: Tokenizer,
    template: ChatTemplate,
    seq_len: int,
    *,
    stop_on_refused: bool = False,
) -> dict[str, Any]:
    """Write the rows of ``inputs`` to ``output_dir``, one window each; returns the
    meta.json written.

    One process, no held-out split and no shards, as a preference set is written. A row
    that does not fit a window is dropped and counted (--long-conversations has no cut
    here). A DataError names the file and line of a bad row.
    """
    files = discover_input_files(inputs)
    counts = PromptCounts()
    with TokenFileWriter(output_dir, tokenizer, masked=True) as writer:
        for path in files:
            for row in read_prompts(path):
                try:
                    text = template.render(row.messages, add_generation_prompt=True)
                except DataError as exc:
                    if stop_on_refused:
                        raise DataError(f"{row.where}: {exc}") from None
                    counts.prompts_refused += 1
                    continue
                tokens, mask = encode_prompt_row(tokenizer, text, row.answer)
                if len(tokens) > seq_len:
                    counts.prompts_dropped += 1
                    continue
                writer.add_document(tokens, mask)
                if len(tokens) < seq_len:
                    writer.add_padding(seq_len - len(tokens))
                    counts.pad_tokens += seq_len - len(tokens)
                counts.prompts += 1
        if counts.prompts == 0:
            raise DataError(
                f"{output_dir}: no prompt to write ({counts.prompts_dropped} dropped as longer "
                f"than --seq-len {seq_len} with their answer, {counts.prompts_refused} refused "
                "by the chat template)"
            )
        writer.add_padding(1)  # the last window's (N + 1)-th token
        counts.pad_tokens += 1
        return writer.finish(
            len(files),
            {"format": PROMPTS_FORMAT, "packed_seq_len": seq_len, **vars(counts)},
        )
