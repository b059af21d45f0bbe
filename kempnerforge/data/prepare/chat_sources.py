"""Conversation inputs of prepare-data --format chat: .jsonl (optionally .gz) lines, parquet rows
and saved Hugging Face dataset rows, each one conversation.

Files are found as for text (sources.discover_input_files) and streamed one conversation at a
time; every error names the file and the line or row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from kempnerforge.core.errors import DataError
from kempnerforge.data.chat import Conversation, conversation_of
from kempnerforge.data.prepare.sources import (
    decode_utf8,
    import_pyarrow,
    input_kind,
    load_saved_dataset,
    open_binary,
    read_errors,
)

# Rows decoded at once from a parquet file or a saved dataset.
_ROWS_PER_READ = 256
PROMPT_COMPLETION = ("prompt", "completion")


def read_conversations(
    path: Path, messages_field: str = "messages", split: str | None = None
) -> Iterator[Conversation]:
    """The conversations of one input, in order; blank .jsonl lines are skipped.

    A record holds ``messages_field`` (a list of messages) or 'prompt' and 'completion'
    (see chat.conversation_of). A .txt file holds no conversations and is refused.
    """
    kind = input_kind(path)
    if kind == "parquet":
        yield from _read_parquet(path, messages_field)
    elif kind == "hf":
        yield from _read_hf_dataset(path, messages_field, split)
    elif kind == "jsonl":
        yield from _read_jsonl(path, messages_field)
    else:
        raise DataError(
            f"{path}: a text file holds no conversations; --format chat reads .jsonl "
            "(optionally .gz), .parquet and saved Hugging Face datasets, one conversation each"
        )


def _read_jsonl(path: Path, messages_field: str) -> Iterator[Conversation]:
    for where, record in jsonl_records(path):
        yield conversation_of(record, where, messages_field)


def jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, record) of each non-blank line of a .jsonl file (optionally .gz), in order,
    ``where`` being 'path:line' for errors; a line that is not JSON is a DataError."""
    with read_errors(path), open_binary(path) as stream:
        for number, raw in enumerate(stream, start=1):
            where = f"{path}:{number}"
            line = decode_utf8(raw, where)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    f"{where}: not valid JSON ({exc.msg}); fix or remove the line"
                ) from None
            yield where, record


def conversation_columns(path: Path, columns: list[str], messages_field: str) -> list[str]:
    """The columns a conversation is read from: ``messages_field``, else prompt and
    completion; DataError naming the columns there are when neither is present."""
    if messages_field in columns:
        return [messages_field]
    if all(c in columns for c in PROMPT_COMPLETION):
        return list(PROMPT_COMPLETION)
    raise DataError(
        f"{path}: no {messages_field!r} column and no 'prompt' and 'completion' columns "
        f"(columns: {', '.join(columns) or 'none'}); pass --text-field to name the messages column"
    )


def _rows(batch: dict[str, list[Any]], columns: list[str]) -> Iterator[dict[str, Any]]:
    """Records of one column-wise batch, null values left out (as a missing key)."""
    for values in zip(*(batch[c] for c in columns), strict=True):
        yield {c: v for c, v in zip(columns, values, strict=True) if v is not None}


def _read_parquet(path: Path, messages_field: str) -> Iterator[Conversation]:
    pa, pq = import_pyarrow(path)
    try:
        parquet = pq.ParquetFile(path)
        columns = conversation_columns(path, parquet.schema_arrow.names, messages_field)
        row = 0
        for batch in parquet.iter_batches(batch_size=_ROWS_PER_READ, columns=columns):
            for record in _rows(batch.to_pydict(), columns):
                yield conversation_of(record, f"{path}: row {row}", messages_field)
                row += 1
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{path}: not a readable parquet file ({exc}); rewrite or remove it"
        ) from None


def _read_hf_dataset(path: Path, messages_field: str, split: str | None) -> Iterator[Conversation]:
    loaded = load_saved_dataset(path, split)
    columns = conversation_columns(path, list(loaded.column_names), messages_field)
    row = 0
    for batch in loaded.select_columns(columns).iter(batch_size=_ROWS_PER_READ):
        # Batched iteration yields column -> values dicts (the stubs also allow a list).
        for record in _rows(cast(dict[str, list[Any]], batch), columns):
            yield conversation_of(record, f"{path}: row {row}", messages_field)
            row += 1
