"""Raw text inputs of prepare-data: finding .txt / .jsonl files (optionally .gz) and reading them.

Documents are yielded one at a time so a corpus of any size streams through.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from kempnerforge.data.errors import DataError
from kempnerforge.metrics.logging import get_logger

logger = get_logger(__name__)

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")


def _kind(path: Path) -> str | None:
    """'txt' or 'jsonl' for a supported file name, else None."""
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix.split(".")[1]
    return None


def discover_input_files(inputs: list[str]) -> list[Path]:
    """Input files in a deterministic order: arguments as given, directories walked sorted.

    A file listed twice (directly or through a directory) is read once.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.exists():
            raise DataError(f"{raw}: input path does not exist; check the --input argument")
        if path.is_dir():
            found = sorted(
                (p for p in path.rglob("*") if p.is_file() and _kind(p)),
                key=lambda p: p.relative_to(path).as_posix(),
            )
        elif _kind(path):
            found = [path]
        else:
            raise DataError(
                f"{raw}: unsupported file type; prepare-data reads {', '.join(SUFFIXES)}"
            )
        for file in found:
            key = file.resolve()
            if key in seen:
                logger.warning("%s is listed more than once; reading it once", file)
                continue
            seen.add(key)
            files.append(file)
    if not files:
        raise DataError(
            f"no readable files found in {', '.join(inputs) or '(no inputs)'}: "
            f"prepare-data reads {', '.join(SUFFIXES)}"
        )
    return files


def _open_binary(path: Path) -> IO[bytes]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not valid UTF-8 (byte {exc.start}: {exc.reason}); "
            "convert the file to UTF-8 or leave it out"
        ) from None


def read_documents(path: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one input file: the whole of a .txt, or ``text_field`` of each .jsonl line.

    Blank .jsonl lines are skipped. Raises DataError naming the file (and line) for bytes that
    are not UTF-8, a line that is not a JSON object, or a missing or non-string field.
    """
    kind = _kind(path)
    try:
        with _open_binary(path) as stream:
            if kind == "txt":
                yield _decode(stream.read(), str(path))
                return
            for number, raw in enumerate(stream, start=1):
                line = _decode(raw, f"{path}:{number}")
                if line.strip():
                    yield _text_of(line, text_field, f"{path}:{number}")
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path}: not a readable gzip file ({exc}); re-compress or remove it"
        ) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _text_of(line: str, text_field: str, where: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataError(f"{where}: not valid JSON ({exc.msg}); fix or remove the line") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object with a {text_field!r} field")
    if text_field not in record:
        keys = ", ".join(sorted(map(str, record))) or "none"
        raise DataError(
            f"{where}: no {text_field!r} field (keys: {keys}); pass --text-field to pick one"
        )
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string")
    return text
