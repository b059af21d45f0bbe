"""Reading a task's local file: multiple-choice examples, or documents for bits per byte.

The formats (docs/evaluation.md): a multiple-choice task is JSONL, one example a line,
``{"context": str, "choices": [str, ...], "gold": int}`` (an ``id`` may ride along); a
bits-per-byte task is JSONL of ``{"text": str}`` documents, or any other file read as one
UTF-8 document. A malformed file is a DataError naming the file, the line and what to fix.
Task files are small (thousands of examples): every rank reads the whole file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kempnerforge.core.errors import DataError


@dataclass(frozen=True)
class ChoiceExample:
    """One multiple-choice question: each choice is appended to the context as written."""

    context: str
    choices: tuple[str, ...]
    gold: int


def read_choice_examples(path: str, limit: int = 0) -> list[ChoiceExample]:
    """The file's examples in order, its first ``limit`` only when limit > 0."""
    examples = []
    for line_number, record in _json_lines(path):
        examples.append(_choice_example(record, path, line_number))
        if limit and len(examples) == limit:
            break
    if not examples:
        raise DataError(f"{path}: no examples (one JSON object a line: context, choices, gold)")
    return examples


def read_documents(path: str, limit: int = 0) -> list[str]:
    """The documents of a bits-per-byte task: the "text" of each JSONL line, or the whole
    file as one document when it is not a .jsonl file."""
    if not path.endswith(".jsonl"):
        with open(_existing(path), encoding="utf-8") as f:
            return [f.read()]
    documents = []
    for line_number, record in _json_lines(path):
        text = record.get("text")
        if not isinstance(text, str):
            raise DataError(f'{path}:{line_number}: expected a string "text"; got {text!r:.80}')
        documents.append(text)
        if limit and len(documents) == limit:
            break
    if not documents:
        raise DataError(f'{path}: no documents (one JSON object a line with a "text" string)')
    return documents


def with_shots(examples: list[ChoiceExample], shots: list[ChoiceExample]) -> list[ChoiceExample]:
    """Every example with the solved ``shots`` before its context: each shot's context and
    gold choice, then a blank line."""
    prefix = "".join(f"{s.context}{s.choices[s.gold]}\n\n" for s in shots)
    return [ChoiceExample(prefix + e.context, e.choices, e.gold) for e in examples]


def _existing(path: str) -> str:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such task file (eval.tasks path, fewshot_path)")
    return path


def _json_lines(path: str):
    """(line number, object) for each non-blank line of a JSONL file."""
    with open(_existing(path), encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}:{line_number}: not JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:{line_number}: expected a JSON object a line")
            yield line_number, record


def _choice_example(record: dict[str, Any], path: str, line_number: int) -> ChoiceExample:
    where = f"{path}:{line_number}"
    context, choices, gold = record.get("context"), record.get("choices"), record.get("gold")
    if not isinstance(context, str):
        raise DataError(f'{where}: expected a string "context"; got {context!r:.80}')
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise DataError(f'{where}: expected "choices", a list of 2 or more non-empty strings')
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise DataError(
            f'{where}: expected "gold", the index of the right choice in 0..{len(choices) - 1};'
            f" got {gold!r:.80}"
        )
    return ChoiceExample(context, tuple(choices), gold)
