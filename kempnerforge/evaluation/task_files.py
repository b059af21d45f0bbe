"""Reading a task's local file: multiple-choice examples, or documents for bits per byte.

The formats (docs/evaluation.md): a multiple-choice task is JSONL, one example a line,
``{"context": str, "choices": [str, ...], "gold": int}``, optionally with a ``subject`` (its
few-shot examples are those of its subject, its accuracy is also reported per subject) and
a ``description`` (text before its few-shot examples and its context); an ``id`` may ride
along. A bits-per-byte task is JSONL of ``{"text": str}`` documents, or any other file read as one
UTF-8 document. A malformed file is a DataError naming the file, the line and what to fix.
Task files are small (thousands of examples): every rank reads the whole file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kempnerforge.core.errors import DataError

TASK_FIX = 'write one object a line: {"context": ..., "choices": [...], "gold": ...}'
DOCUMENTS_FIX = 'write one object a line: {"text": ...}'


@dataclass(frozen=True)
class ChoiceExample:
    """One multiple-choice question: each choice is appended to the prompt as written, the
    prompt being the description, the few-shot examples (with_prompts) and the context."""

    context: str
    choices: tuple[str, ...]
    gold: int
    subject: str | None = None
    description: str = ""


def read_choice_examples(path: str, limit: int = 0) -> list[ChoiceExample]:
    """The file's examples in order, its first ``limit`` only when limit > 0."""
    examples = []
    for where, record in json_lines(path, TASK_FIX):
        examples.append(_choice_example(record, where))
        if limit and len(examples) == limit:
            break
    if not examples:
        raise DataError(f"{path}: no examples (one JSON object a line: context, choices, gold)")
    return examples


def read_documents(path: str, limit: int = 0) -> list[str]:
    """The documents of a bits-per-byte task: the "text" of each JSONL line, or the whole
    file as one document when it is not a .jsonl file."""
    if not path.endswith(".jsonl"):
        return [read_text(path, "the task's text")]
    documents = []
    for where, record in json_lines(path, DOCUMENTS_FIX):
        text = record.get("text")
        if not isinstance(text, str):
            raise DataError(f'{where}: "text" is {json_kind(text)}, expected a string')
        documents.append(text)
        if limit and len(documents) == limit:
            break
    if not documents:
        raise DataError(f'{path}: no documents (one JSON object a line with a "text" string)')
    return documents


def with_prompts(
    examples: list[ChoiceExample], shots: list[ChoiceExample], num_shots: int, shots_path: str
) -> list[ChoiceExample]:
    """Every example with its prompt in its context: its description, then the first
    ``num_shots`` of ``shots`` (read from ``shots_path``) of its subject (for an example
    without a subject, the shots without one), each the shot's context, its gold choice and
    a blank line, then its own context. A DataError names a subject with too few shots."""
    by_subject: dict[str | None, list[ChoiceExample]] = {}
    for shot in shots:
        by_subject.setdefault(shot.subject, []).append(shot)
    prefixes: dict[str | None, str] = {}
    prompted = []
    for example in examples:
        if example.subject not in prefixes:
            chosen = by_subject.get(example.subject, [])[:num_shots]
            if len(chosen) < num_shots:
                raise DataError(_too_few_shots(shots_path, example.subject, len(chosen), num_shots))
            prefixes[example.subject] = "".join(
                f"{s.context}{s.choices[s.gold]}\n\n" for s in chosen
            )
        context = example.description + prefixes[example.subject] + example.context
        prompted.append(replace(example, context=context, description=""))
    return prompted


def _too_few_shots(path: str, subject: str | None, found: int, wanted: int) -> str:
    which = f'of subject "{subject}"' if subject is not None else "without a subject"
    return (
        f"{path}: {found} solved example(s) {which}, num_fewshot = {wanted} needs {wanted}; "
        "give the solved examples of every subject of the task (for MMLU, convert its data/dev "
        "folder) or lower num_fewshot"
    )


def read_text(path: str | Path, what: str, error: type[DataError] = DataError) -> str:
    """The whole of ``path`` as UTF-8 text; a missing, unreadable or non-UTF-8 file raises
    ``error`` naming it (``what`` says which file was expected)."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise error(f"{path}: no such file; give the path of {what}") from None
    except IsADirectoryError:
        raise error(f"{path}: a folder, not a file; name {what} in it") from None
    except UnicodeDecodeError as problem:
        raise error(
            f"{path}: not UTF-8 text ({problem.reason} at byte {problem.start}); give {what} "
            "as UTF-8"
        ) from None


def json_lines(
    path: str | Path, fix: str, error: type[DataError] = DataError, what: str = "the task file"
) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for each non-blank line of a JSON-lines file: ``where`` names the
    file and line for messages, ``fix`` says what to do when a line is not an object,
    ``what`` which file was expected."""
    for number, line in enumerate(read_text(path, what, error).split("\n"), 1):
        if not line.strip():
            continue
        where = f"{path}, line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as problem:
            raise error(
                f"{where}: not JSON ({problem.msg} at column {problem.colno}); {fix}"
            ) from None
        if not isinstance(record, dict):
            raise error(f"{where}: {json_kind(record)}, not an object; {fix}")
        yield where, record


def json_kind(value: Any) -> str:
    """What a value (or a type) is called in JSON, for messages."""
    kind = value if isinstance(value, type) else type(value)
    names = {str: "a string", int: "an integer", list: "a list", dict: "an object"}
    return "null" if value is None else names.get(kind, f"a {kind.__name__}")


def _choice_example(record: dict[str, Any], where: str) -> ChoiceExample:
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
    subject, description = record.get("subject"), record.get("description", "")
    if subject is not None and (not isinstance(subject, str) or not subject):
        raise DataError(f'{where}: expected "subject", a non-empty string; got {subject!r:.80}')
    if not isinstance(description, str):
        raise DataError(f'{where}: expected "description", a string; got {description!r:.80}')
    return ChoiceExample(context, tuple(choices), gold, subject, description)
