"""Raw text inputs of prepare-data: finding and reading .txt / .jsonl (optionally .gz), .parquet
files and saved Hugging Face datasets.

Documents are yielded one at a time so a corpus of any size streams through.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)

SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz", ".parquet")
SUPPORTED = f"{', '.join(SUFFIXES)} files and Hugging Face save_to_disk directories"
# Rows decoded at once from a parquet file or a saved dataset: the most text held per read.
_ROWS_PER_READ = 1024


def check_text_suffixes(suffixes: Iterable[str]) -> tuple[str, ...]:
    """``--text-suffix`` values, lower-cased: each like '.py', and not a structured format."""
    checked = []
    for suffix in suffixes:
        lowered = suffix.lower()
        if not lowered.startswith(".") or len(lowered) < 2 or "/" in lowered:
            raise DataError(f"--text-suffix {suffix!r}: expected a file suffix like .py or .md")
        if any(lowered == s or lowered == s.removesuffix(".gz") for s in SUFFIXES):
            raise DataError(
                f"--text-suffix {suffix!r}: {lowered} files are read already; list only "
                "other suffixes to read as whole-file text"
            )
        checked.append(lowered)
    return tuple(checked)


def input_kind(path: Path, text_suffixes: tuple[str, ...] = ()) -> str | None:
    """'txt', 'jsonl', 'parquet' or 'hf' for a supported input, else None.

    A file ending in one of ``text_suffixes`` (optionally .gz) is whole-file text: 'txt'.
    """
    if path.is_dir():
        return "hf" if is_hf_dataset_dir(path) else None
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix.split(".")[1]
    if any(name.endswith((suffix, suffix + ".gz")) for suffix in text_suffixes):
        return "txt"
    return None


def is_hf_dataset_dir(path: Path) -> bool:
    """Whether ``path`` is a directory written by ``Dataset(Dict).save_to_disk``."""
    if (path / "dataset_dict.json").is_file():
        return True
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def discover_input_files(inputs: list[str], text_suffixes: tuple[str, ...] = ()) -> list[Path]:
    """Inputs in a deterministic order: arguments as given, directories walked sorted.

    A saved Hugging Face dataset is one input and is not searched inside. An input listed
    twice (directly or through a directory) is read once. Files ending in one of
    ``text_suffixes`` are found and read as whole-file text, like .txt.
    """
    files: list[Path] = []
    seen: set[Path] = set()
    for raw in inputs:
        path = Path(raw).expanduser()
        if not path.exists():
            raise DataError(f"{raw}: input path does not exist; check the --input argument")
        if path.is_dir() and not is_hf_dataset_dir(path):
            found = _walk(path, text_suffixes)
        elif input_kind(path, text_suffixes):
            found = [path]
        else:
            raise DataError(
                f"{raw}: unsupported file type; prepare-data reads {SUPPORTED} (and, with "
                "--text-suffix, other suffixes as whole-file text)"
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
            f"prepare-data reads {SUPPORTED} (other suffixes with --text-suffix)"
        )
    return files


def _walk(root: Path, text_suffixes: tuple[str, ...]) -> list[Path]:
    """Supported files and saved datasets under ``root``, sorted by relative path.

    The other files are left out with one warning that counts them by suffix, so a tree
    of source code read without --text-suffix does not go unnoticed (tool files, such as
    those under .git or __pycache__, are not counted).
    """
    entries = list(root.rglob("*"))
    datasets = {p for p in entries if p.is_dir() and is_hf_dataset_dir(p)}
    found: list[Path] = []
    skipped: Counter[str] = Counter()
    for p in entries:
        if any(parent in datasets for parent in p.parents):
            continue
        if p in datasets or (p.is_file() and input_kind(p, text_suffixes)):
            found.append(p)
        elif p.is_file() and not _is_tooling(p.relative_to(root)):
            skipped[_suffix_of(p)] += 1
    if skipped:
        logger.warning("%s", describe_skipped(skipped, root))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _is_tooling(relative: Path) -> bool:
    """Whether a skipped file is a tool's, not text someone forgot: inside a hidden directory
    (.git, .venv) or __pycache__, or hidden itself; such files are not worth a warning."""
    return any(part.startswith(".") or part == "__pycache__" for part in relative.parts)


def _suffix_of(path: Path) -> str:
    """The suffix --text-suffix would name to read ``path``: '.py' for a.py and a.py.gz, ''
    for none."""
    suffixes = [s.lower() for s in path.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] == ".gz":
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


# Skipped suffixes named one by one in the warning; the rest are summed up.
_NAMED_SUFFIXES = 6


def describe_skipped(skipped: Counter[str], root: Path) -> str:
    """One line: how many files of which suffix were left out under ``root``, and the
    --text-suffix options that would read them."""
    # Most frequent first; files without a suffix after the others of their count.
    by_count = sorted(skipped.items(), key=lambda item: (-item[1], item[0] == "", item[0]))
    named, rest = by_count[:_NAMED_SUFFIXES], by_count[_NAMED_SUFFIXES:]
    parts = [f"{count} {suffix or 'no-suffix'}" for suffix, count in named]
    if rest:
        parts.append(f"{sum(count for _, count in rest)} other")
    counts = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    total = sum(skipped.values())
    under = root.as_posix().rstrip("/") + "/"
    why = "not a format prepare-data reads"
    structured = {s.removesuffix(".gz") for s in SUFFIXES}
    readable = [suffix for suffix, _ in named if suffix and suffix not in structured]
    if readable:
        options = " ".join(f"--text-suffix {suffix}" for suffix in readable)
        why += f"; read {'them' if total > 1 else 'it'} as whole-file text with {options}"
    return f"skipped {counts} file{'s' if total > 1 else ''} under {under} ({why})"


def open_binary(path: Path) -> IO[bytes]:
    """``path`` opened for reading bytes, decompressed when its name ends in .gz."""
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rb")  # type: ignore[return-value]  # a GzipFile is a binary IO
    return open(path, "rb")


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` as text; DataError naming ``where`` and the first bad byte if not UTF-8."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{where}: not valid UTF-8 (byte {exc.start}: {exc.reason}); "
            "convert the file to UTF-8 or leave it out"
        ) from None


@contextmanager
def read_errors(path: Path) -> Iterator[None]:
    """What reading ``path`` raises from gzip or the OS, as a DataError naming the file and
    what to do."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(
            f"{path}: not a readable gzip file ({exc}); re-compress or remove it"
        ) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def read_documents(
    path: Path,
    text_field: str = "text",
    split: str | None = None,
    *,
    text_suffixes: tuple[str, ...] = (),
    skip_non_utf8: bool = False,
) -> Iterator[str]:
    """Documents of one input: the whole of a .txt (or a ``text_suffixes`` file), or
    ``text_field`` of each .jsonl line, parquet row or saved-dataset row (``split`` of a
    DatasetDict, default 'train').

    Blank .jsonl lines and null parquet / dataset values are skipped. Raises DataError naming
    the file (and line) for bytes that are not UTF-8, a line that is not a JSON object, or a
    missing or non-string field; with ``skip_non_utf8`` a whole-file document that is not
    UTF-8 is left out with a warning instead.
    """
    kind = input_kind(path, text_suffixes)
    if kind == "parquet":
        yield from _read_parquet(path, text_field)
        return
    if kind == "hf":
        yield from _read_hf_dataset(path, text_field, split)
        return
    with read_errors(path), open_binary(path) as stream:
        if kind == "txt":
            data = stream.read()
            if skip_non_utf8 and not _is_utf8(data):
                logger.warning("%s is not valid UTF-8: left out (--skip-non-utf8)", path)
                return
            yield decode_utf8(data, str(path))
            return
        for number, raw in enumerate(stream, start=1):
            line = decode_utf8(raw, f"{path}:{number}")
            if line.strip():
                yield _text_of(line, text_field, f"{path}:{number}")


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


def _check_column(path: Path, text_field: str, columns: list[str], type_name: str | None) -> None:
    """A missing or non-string text column is a DataError naming the columns there are."""
    if text_field not in columns:
        raise DataError(
            f"{path}: no {text_field!r} column (columns: {', '.join(columns) or 'none'}); "
            "pass --text-field to pick one"
        )
    if type_name is not None:
        raise DataError(f"{path}: column {text_field!r} holds {type_name}, not strings")


def import_pyarrow(path: Path) -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet) for reading the parquet file ``path``; DataError naming it
    and the extra to install when pyarrow is missing."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            f"{path}: reading parquet needs the 'pyarrow' package: "
            "pip install kempnerforge[parquet]"
        ) from None
    return pa, pq


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    """``text_field`` of each row, read one batch of rows at a time."""
    pa, pq = import_pyarrow(path)
    try:
        parquet = pq.ParquetFile(path)
        schema = parquet.schema_arrow
        column_type = schema.field(text_field).type if text_field in schema.names else None
        is_text = column_type is None or _is_arrow_string(pa, column_type)
        _check_column(path, text_field, schema.names, None if is_text else str(column_type))
        for batch in parquet.iter_batches(batch_size=_ROWS_PER_READ, columns=[text_field]):
            for text in batch.column(0).to_pylist():
                if text is not None:
                    yield text
    except (pa.ArrowException, OSError) as exc:
        raise DataError(
            f"{path}: not a readable parquet file ({exc}); rewrite or remove it"
        ) from None


def _is_arrow_string(pa: Any, arrow_type: Any) -> bool:
    string_view = getattr(pa.types, "is_string_view", lambda _t: False)
    return (
        pa.types.is_string(arrow_type)
        or pa.types.is_large_string(arrow_type)
        or string_view(arrow_type)
    )


def _read_hf_dataset(path: Path, text_field: str, split: str | None) -> Iterator[str]:
    """``text_field`` of each row of a saved dataset, streamed from its memory-mapped arrow."""
    loaded = load_saved_dataset(path, split)
    feature = loaded.features.get(text_field)
    is_text = getattr(feature, "dtype", None) in ("string", "large_string")
    _check_column(path, text_field, list(loaded.column_names), None if is_text else str(feature))
    for rows in loaded.select_columns([text_field]).iter(batch_size=_ROWS_PER_READ):
        # Batched iteration yields column -> values dicts (the stubs also allow a list).
        for text in cast(dict[str, list[Any]], rows)[text_field]:
            if text is not None:
                yield text


def load_saved_dataset(path: Path, split: str | None) -> Any:
    """The rows of a saved dataset: a Dataset, or ``split`` (default 'train') of a
    DatasetDict; DataError naming the splits there are when it has no such split."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{path}: reading a saved Hugging Face dataset needs the 'datasets' package: "
            "pip install kempnerforge[hf-datasets]"
        ) from None
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as exc:
        raise DataError(f"{path}: not a readable saved dataset ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        name = split or "train"
        splits = [str(s) for s in loaded]
        if name not in splits:
            raise DataError(
                f"{path}: no split {name!r} (splits: {', '.join(splits) or 'none'}); "
                "pass --split to pick one"
            )
        loaded = loaded[name]  # type: ignore[index]  # DatasetDict is keyed by split names
    elif split is not None:
        logger.warning(
            "%s is a single dataset, not a DatasetDict; --split %s is ignored", path, split
        )
    return loaded
