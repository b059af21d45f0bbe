"""Converters from public multiple-choice sets, read from the files their authors release, to
our task format: one JSON object a line with ``context``, ``choices``, ``gold`` and an
optional ``id``, each choice appended to the context exactly as written.

Nothing is downloaded: a converter reads the files the user has and returns the examples;
``write_examples`` writes them. The templates are those of the common evaluation harnesses,
so that scores compare with theirs (docs/evaluation.md, "Converting public sets", lists them).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NotRequired, TypedDict, TypeVar

from kempnerforge.core.errors import DataError
from kempnerforge.evaluation.task_files import json_kind as _json_kind
from kempnerforge.evaluation.task_files import json_lines, read_text

StrPath = str | os.PathLike[str]
T = TypeVar("T")


class Example(TypedDict):
    """One multiple-choice example: the model scores ``description + context + choice`` for
    each choice (few-shot examples of the same ``subject`` go between description and
    context)."""

    context: str
    choices: list[str]
    gold: int
    id: NotRequired[str]
    subject: NotRequired[str]
    description: NotRequired[str]


class ConvertError(DataError, ValueError):
    """A set's file cannot be converted: names the file, the line or row, what is wrong and
    what to do. A DataError, so the command line prints it as one line and exits with code 2.
    """


# Reading the released files.


def _read_jsonl(path: Path, release: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, object) for each non-blank line of a released JSON-lines file; ``release``
    names the file expected, for messages."""
    return json_lines(path, f"give {release}", ConvertError, "the set's file")


def _read_text(path: Path) -> str:
    return read_text(path, "the set's file", ConvertError)


def _field(record: dict[str, Any], key: str, kind: type[T], where: str, name: str = "") -> T:
    """``record[key]`` checked to be a ``kind``; ``name`` is how messages call the field
    (its path in the line, e.g. ``question.stem``), ``key`` by default."""
    name = name or key
    if key not in record:
        raise ConvertError(f"{where}: no '{name}' field; is this the set's file as released?")
    value = record[key]
    if not isinstance(value, kind):
        raise ConvertError(
            f"{where}: '{name}' is {_json_kind(value)}, expected {_json_kind(kind)}; is this "
            "the set's file as released?"
        )
    return value


def _strings(record: dict[str, Any], key: str, where: str, name: str = "") -> list[str]:
    """``record[key]`` checked to be a list of strings."""
    values = _field(record, key, list, where, name)
    for index, value in enumerate(values):
        if not isinstance(value, str):
            raise ConvertError(
                f"{where}: '{name or key}[{index}]' is {_json_kind(value)}, expected a string"
            )
    return values


def _at_least_two(choices: list[str], where: str) -> list[str]:
    """``choices`` when there are two or more: one choice is no question."""
    if len(choices) < 2:
        raise ConvertError(
            f"{where}: only {len(choices)} choice(s), a question needs two or more; fix the "
            "line or leave it out"
        )
    return choices


def _non_empty(examples: list[Example], path: Path) -> list[Example]:
    if not examples:
        raise ConvertError(f"{path}: no examples in it; is it the set's file as released?")
    return examples


# HellaSwag.

HELLASWAG_RELEASE = "HellaSwag's hellaswag_val.jsonl (or hellaswag_train.jsonl) as released"
_BRACKETED_TAG = re.compile(r"\[.*?\]")


def clean_hellaswag_text(text: str) -> str:
    """HellaSwag text as the common harnesses clean it before scoring: stripped, a " [title]"
    tag made a sentence end, the other WikiHow tags ("[header]", "[step]") dropped, then
    each double space made single (in one pass, as they do)."""
    text = text.strip().replace(" [title]", ". ")
    return _BRACKETED_TAG.sub("", text).replace("  ", " ")


def convert_hellaswag(paths: Sequence[StrPath]) -> list[Example]:
    """HellaSwag's released jsonl files (hellaswag_val.jsonl for the usual validation score)
    as examples: "activity label: context", then each of the four endings after a space,
    cleaned as the common harnesses clean them, so scores compare with theirs. The test
    file is refused: its answers are not released."""
    examples: list[Example] = []
    for path in map(Path, paths):
        lines = _read_jsonl(path, HELLASWAG_RELEASE)
        examples += _non_empty([_hellaswag_example(record, where) for where, record in lines], path)
    return examples


def _hellaswag_example(record: dict[str, Any], where: str) -> Example:
    endings = _at_least_two(_strings(record, "endings", where), where)
    gold = _hellaswag_label(record, where, len(endings))
    ctx_a = _field(record, "ctx_a", str, where)
    # str.capitalize also lowercases the rest of ctx_b, as the harnesses' preprocessing does.
    ctx_b = _field(record, "ctx_b", str, where).capitalize()
    activity = _field(record, "activity_label", str, where)
    example: Example = {
        "context": clean_hellaswag_text(f"{activity}: {ctx_a} {ctx_b}"),
        "choices": [" " + clean_hellaswag_text(ending) for ending in endings],
        "gold": gold,
    }
    if isinstance(record.get("ind"), int | str):
        example["id"] = str(record["ind"])
    return example


def _hellaswag_label(record: dict[str, Any], where: str, num_endings: int) -> int:
    """The index of the right ending; a line without one (the test split's) is refused."""
    label = record.get("label")
    if record.get("split") == "test" or label is None or label == "":
        raise ConvertError(
            f"{where}: no label (HellaSwag's test split is unlabelled); convert the "
            "validation file, hellaswag_val.jsonl, instead"
        )
    if isinstance(label, str) and label.isdigit():
        label = int(label)  # copies exported from other hubs write the label as text
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < num_endings:
        raise ConvertError(
            f"{where}: label {label!r} is not the index of one of the {num_endings} endings; "
            "fix the line or leave it out"
        )
    return label


# ARC.

ARC_RELEASE = "an ARC jsonl file as released (e.g. ARC-Challenge-Test.jsonl)"


def convert_arc(paths: Sequence[StrPath]) -> list[Example]:
    """AI2 ARC's released jsonl files (ARC-Easy or ARC-Challenge, any split) as examples:
    "Question: {stem}\\nAnswer:" and each choice's text after a space; the gold is the
    position of answerKey among the choices' labels (letters or digits)."""
    examples: list[Example] = []
    for path in map(Path, paths):
        lines = _read_jsonl(path, ARC_RELEASE)
        examples += _non_empty([_arc_example(record, where) for where, record in lines], path)
    return examples


def _arc_example(record: dict[str, Any], where: str) -> Example:
    question = _field(record, "question", dict, where)
    stem = _field(question, "stem", str, where, "question.stem")
    texts, labels = [], []
    for index, choice in enumerate(_field(question, "choices", list, where, "question.choices")):
        name = f"question.choices[{index}]"
        if not isinstance(choice, dict):
            raise ConvertError(f"{where}: '{name}' is {_json_kind(choice)}, expected an object")
        texts.append(_field(choice, "text", str, where, f"{name}.text"))
        labels.append(_field(choice, "label", str, where, f"{name}.label"))
    _at_least_two(texts, where)
    answer = _field(record, "answerKey", str, where)
    if answer not in labels:
        raise ConvertError(
            f"{where}: answerKey {answer!r} is not among the choice labels "
            f"{', '.join(labels) or '(none)'}; fix the line or leave it out"
        )
    example: Example = {
        "context": f"Question: {stem}\nAnswer:",
        "choices": [" " + text for text in texts],
        "gold": labels.index(answer),
    }
    if isinstance(record.get("id"), str):
        example["id"] = record["id"]
    return example


# PIQA.

PIQA_RELEASE = "PIQA's valid.jsonl as released"


def convert_piqa(path: StrPath, labels_path: StrPath) -> list[Example]:
    """PIQA's valid.jsonl (or train.jsonl) with its labels file, valid-labels.lst (one 0 or
    1 a line, in the same order), as examples: "Question: {goal}\\nAnswer:" and the two
    solutions after a space. Files of different lengths are refused: they do not pair."""
    source, labels_file = Path(path), Path(labels_path)
    records = list(_read_jsonl(source, PIQA_RELEASE))
    labels = _read_piqa_labels(labels_file)
    if len(records) != len(labels):
        raise ConvertError(_piqa_count_mismatch(source, labels_file, records, labels))
    examples: list[Example] = []
    for (where, record), (_, gold) in zip(records, labels, strict=True):
        example: Example = {
            "context": f"Question: {_field(record, 'goal', str, where)}\nAnswer:",
            "choices": [" " + _field(record, key, str, where) for key in ("sol1", "sol2")],
            "gold": gold,
        }
        if isinstance(record.get("id"), str):
            example["id"] = record["id"]
        examples.append(example)
    return _non_empty(examples, source)


def _read_piqa_labels(path: Path) -> list[tuple[int, int]]:
    """(line number, label) for each line of a PIQA labels file; blank lines may only end it."""
    lines = _read_text(path).split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    labels = []
    for number, line in enumerate(lines, 1):
        if line.strip() not in ("0", "1"):
            raise ConvertError(
                f"{path}, line {number}: {line.strip()!r} is not a label (0 or 1); give "
                "PIQA's labels file as released (valid-labels.lst)"
            )
        labels.append((number, int(line)))
    return labels


def _piqa_count_mismatch(
    path: Path,
    labels_path: Path,
    records: list[tuple[str, dict[str, Any]]],
    labels: list[tuple[int, int]],
) -> str:
    """The message for a labels file that does not pair with its examples, naming the first
    line left over on the longer side."""
    counts = f"{labels_path} has {len(labels)} labels but {path} has {len(records)} examples"
    if len(records) > len(labels):
        first = f"{records[len(labels)][0]} has no label"
    else:
        first = f"{labels_path}, line {labels[len(records)][0]} has no example"
    return (
        f"{counts} ({first}); give the labels file of the same split (valid-labels.lst for "
        "valid.jsonl)"
    )


# MMLU.

MMLU_SPLIT_SUFFIXES = ("_test.csv", "_dev.csv", "_val.csv")
MMLU_LETTERS = ("A", "B", "C", "D")


def convert_mmlu(paths: Sequence[StrPath]) -> list[Example]:
    """MMLU's released CSV files (data/test/SUBJECT_test.csv, also dev/ and val/), or
    folders of them (every .csv, sorted), as examples in lm-evaluation-harness's mmlu
    prompt: the subject's header as the description (once before any few-shot examples),
    the question and the lettered options as the context, the choices " A" to " D", and
    the subject, whose dev examples are the few-shot examples."""
    return [example for path in _mmlu_files(paths) for example in _mmlu_examples(path)]


def _mmlu_files(paths: Sequence[StrPath]) -> list[Path]:
    files: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            files.append(path)
            continue
        found = sorted(path.glob("*.csv"))
        if not found:
            raise ConvertError(
                f"{path}: no .csv files in this folder; name MMLU's data/test folder or its files"
            )
        files += found
    return files


def mmlu_subject(path: Path) -> str:
    """The subject of an MMLU file, from its released name: ``abstract_algebra_test.csv``
    is ``abstract_algebra``."""
    for suffix in MMLU_SPLIT_SUFFIXES:
        if path.name.endswith(suffix) and len(path.name) > len(suffix):
            return path.name.removesuffix(suffix)
    raise ConvertError(
        f"{path}: cannot tell the subject: MMLU's files are named SUBJECT_test.csv, "
        "SUBJECT_dev.csv or SUBJECT_val.csv; keep the released name"
    )


def _mmlu_examples(path: Path) -> list[Example]:
    subject = mmlu_subject(path)
    # newline="": quoted fields hold line breaks, which the csv module must see as written.
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    examples: list[Example] = []
    try:
        for number, row in enumerate(reader, 1):
            if row:
                where = f"{path}, row {number}"
                examples.append(_mmlu_example(row, subject, number, where))
    except csv.Error as error:
        raise ConvertError(
            f"{path}, line {reader.line_num}: not valid CSV ({error}); give MMLU's file as released"
        ) from None
    return _non_empty(examples, path)


def _mmlu_example(row: list[str], subject: str, number: int, where: str) -> Example:
    if len(row) != 6:
        raise ConvertError(
            f"{where}: {len(row)} columns, expected 6 (question, A, B, C, D, answer letter); "
            "give MMLU's file as released"
        )
    question, *options, answer = row
    if answer.strip() not in MMLU_LETTERS:
        raise ConvertError(
            f"{where}: answer {answer!r} is not one of A, B, C, D; fix the row or leave it out"
        )
    lettered = "".join(
        f"{letter}. {text}\n" for letter, text in zip(MMLU_LETTERS, options, strict=True)
    )
    return {
        # The question is stripped, as the harnesses' template does.
        "context": f"{question.strip()}\n{lettered}Answer:",
        "choices": [" " + letter for letter in MMLU_LETTERS],
        "gold": MMLU_LETTERS.index(answer.strip()),
        "id": f"{subject}/{number}",
        "subject": subject,
        "description": (
            "The following are multiple choice questions (with answers) about "
            f"{subject.replace('_', ' ')}.\n\n"
        ),
    }


# The table and the output file.

CONVERTERS: dict[str, Callable[..., list[Example]]] = {
    "hellaswag": convert_hellaswag,
    "arc": convert_arc,
    "piqa": convert_piqa,
    "mmlu": convert_mmlu,
}
"""Each set's converter. piqa's takes its one jsonl file and its labels file; the others a
sequence of files (mmlu's also folders)."""


def write_examples(examples: Sequence[Example], path: StrPath) -> None:
    """Write ``examples`` to ``path`` as JSON lines (UTF-8, non-ASCII characters as they are),
    creating its folder. The file appears whole: it is written beside and then renamed."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    with partial.open("w", encoding="utf-8") as out:
        for example in examples:
            out.write(json.dumps(example, ensure_ascii=False) + "\n")
    os.replace(partial, target)
