"""Checking the token ids of a prepared directory against a vocabulary without reading them all.

The writer records the largest id in meta.json (``max_token_id``), so opening compares one
number. A directory prepared before that was recorded is scanned once, when small enough,
and the result recorded beside it; a large one is refused with the command that records it,
so that no job has every rank read a large file at startup.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.tokens.token_file import (
    DTYPES,
    MAX_ID_KEY,
    META_FILE,
    TOKENS_FILE,
    check_tokens_file,
    read_meta,
)
from kempnerforge.storage.location import is_store_url, join

logger = get_logger(__name__)

# A tokens.bin without a recorded largest id is scanned on open only up to this size
# (128M uint16 tokens, a fraction of a second from the page cache); a larger one is refused.
SCAN_ON_OPEN_MAX_BYTES = 256 << 20
# Tokens read at once when scanning tokens.bin: 32-64 MB mapped.
_SCAN_TOKENS = 1 << 24
RECORD_COMMAND = "kempnerforge prepare-data --record-max-id"


def id_limit(meta: dict[str, Any], model_vocab_size: int | None) -> int:
    """Every id must be below this: meta.json's vocab_size, and the model's when given."""
    vocab_size = int(meta["vocab_size"])
    return vocab_size if model_vocab_size is None else min(vocab_size, model_vocab_size)


def scan_max_id(path: Path, meta: dict[str, Any]) -> int:
    """The largest id in tokens.bin at ``path`` (-1 when empty), read in bounded chunks."""
    num_tokens = int(meta["num_tokens"])
    if num_tokens == 0:
        return -1
    tokens = np.memmap(path, dtype=DTYPES[meta["dtype"]], mode="r", shape=(num_tokens,))
    return max(
        int(tokens[start : start + _SCAN_TOKENS].max())
        for start in range(0, num_tokens, _SCAN_TOKENS)
    )


def first_id_at_least(path: Path, meta: dict[str, Any], limit: int) -> tuple[int, int] | None:
    """Offset and value of the first id >= ``limit`` in tokens.bin at ``path``, or None.

    Read in chunks through a memory map, so memory stays bounded for any file size; skipped
    when the stored dtype cannot hold such an id.
    """
    dtype = DTYPES[meta["dtype"]]
    num_tokens = int(meta["num_tokens"])
    if limit > np.iinfo(dtype).max or num_tokens == 0:
        return None
    tokens = np.memmap(path, dtype=dtype, mode="r", shape=(num_tokens,))
    for start in range(0, num_tokens, _SCAN_TOKENS):
        chunk = tokens[start : start + _SCAN_TOKENS]
        if int(chunk.max()) >= limit:
            offset = int(np.argmax(chunk >= limit))
            return start + offset, int(chunk[offset])
    return None


def id_beyond_vocab(
    where: str, token_id: int, meta: dict[str, Any], model_vocab_size: int | None
) -> DataError:
    """The error for ``token_id``, found ``where`` (a file and what it holds there), at or
    beyond meta.json's vocab_size or the model's.

    Beyond meta.json's vocabulary, the file is corrupt or not what meta.json says (a wrong
    dtype, another tokenizer); only beyond the model's, the model is too small for the data.
    """
    vocab_size = int(meta["vocab_size"])
    if token_id >= vocab_size:
        model = ""
        if model_vocab_size is not None and token_id >= model_vocab_size:
            model = f" and model.vocab_size {model_vocab_size}"
        return DataError(
            f"{where}, not below meta.json's vocab_size {vocab_size}{model}: the file is corrupt "
            f"or was not written as the {meta['dtype']} ids of tokenizer {meta['tokenizer']} "
            "that meta.json names; run prepare-data again with this job's tokenizer"
        )
    return DataError(
        f"{where}, not below model.vocab_size {model_vocab_size}; raise model.vocab_size to at "
        f"least {vocab_size} or prepare the data again with this job's tokenizer"
    )


def token_at_error(
    path: Path | str, offset: int, token_id: int, meta: dict[str, Any], model_vocab_size: int | None
) -> DataError:
    """The error for id ``token_id`` at token ``offset`` of tokens.bin at ``path``."""
    where = f"{path}: the token at offset {offset} is id {token_id}"
    return id_beyond_vocab(where, token_id, meta, model_vocab_size)


def check_token_ids(data_dir: str, meta: dict[str, Any], model_vocab_size: int | None) -> None:
    """Every id of the prepared directory is below meta.json's vocab_size (and the model's),
    judged from its recorded largest id: tokens.bin is not read.

    An embedding lookup would fail on such an id mid-run, so it is refused when the data is
    opened. A small file is then searched for the offset of the first bad id, to name it.
    """
    top = known_max_id(data_dir, meta)
    limit = id_limit(meta, model_vocab_size)
    if top < limit:
        return
    tokens = join(data_dir, TOKENS_FILE)
    if not is_store_url(data_dir) and Path(tokens).stat().st_size <= SCAN_ON_OPEN_MAX_BYTES:
        found = first_id_at_least(Path(tokens), meta, limit)
        if found is not None:
            raise token_at_error(tokens, *found, meta, model_vocab_size)
    where = f"{tokens}: its largest id, meta.json's {MAX_ID_KEY}, is {top}"
    raise id_beyond_vocab(where, top, meta, model_vocab_size)


def known_max_id(data_dir: str, meta: dict[str, Any]) -> int:
    """meta.json's max_token_id; for a directory prepared before it was recorded, found once.

    A tokens.bin up to SCAN_ON_OPEN_MAX_BYTES is scanned and the result recorded in its
    meta.json (and set in ``meta``), so the next opening reads it; a larger one is refused
    with the command that records it, once, instead of every rank of every job reading it.
    """
    recorded = meta.get(MAX_ID_KEY)
    if recorded is not None:
        return int(recorded)
    if is_store_url(data_dir):
        # Every rank would download tokens.bin to scan it, and could not record the result.
        raise DataError(
            f"{data_dir}: meta.json records no {MAX_ID_KEY} (prepared by an older version); "
            f"record it with `{RECORD_COMMAND} DIR` on a local copy and upload its meta.json, "
            "or prepare the corpus again"
        )
    tokens = Path(data_dir) / TOKENS_FILE
    size = tokens.stat().st_size
    if size > SCAN_ON_OPEN_MAX_BYTES:
        raise DataError(
            f"{data_dir}: meta.json records no {MAX_ID_KEY} (prepared by an older version) "
            f"and tokens.bin is {size / 2**30:.1f} GiB, too large for every rank to scan at "
            f"startup; record it once with `{RECORD_COMMAND} {data_dir}`"
        )
    top = scan_max_id(tokens, meta)
    try:
        record_max_id(data_dir, top)
    except OSError as exc:
        logger.warning(
            "%s: cannot record %s in meta.json (%s): every opening scans tokens.bin again; "
            "run `%s %s` where the directory is writable",
            data_dir,
            MAX_ID_KEY,
            exc.strerror or exc,
            RECORD_COMMAND,
            data_dir,
        )
    meta[MAX_ID_KEY] = top
    return top


def record_max_id(data_dir: str, top: int) -> None:
    """Set max_token_id in ``data_dir``'s meta.json to ``top``, keeping everything else.

    Written to a file of its own and renamed over meta.json, so a reader sees the old or the
    new file whole; processes recording the same directory at once write identical files.
    The new file keeps meta.json's permission bits.
    """
    meta_path = Path(data_dir) / META_FILE
    raw = json.loads(meta_path.read_text(encoding="utf-8"))
    raw[MAX_ID_KEY] = top
    mode = stat.S_IMODE(meta_path.stat().st_mode)
    fd, tmp = tempfile.mkstemp(prefix=f".{META_FILE}.tmp-", dir=data_dir)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(raw, indent=2) + "\n")
        os.chmod(tmp, mode)
        os.replace(tmp, meta_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def scan_and_record(data_dir: str) -> tuple[dict[str, Any], int]:
    """Scan one prepared directory's tokens.bin and record its largest id in meta.json;
    returns its metadata (with the id) and the id.

    An id beyond meta.json's vocab_size is recorded all the same: the truth about the file,
    so every later opening refuses it without a scan.
    """
    meta = read_meta(data_dir)
    top = scan_max_id(Path(check_tokens_file(data_dir, meta)), meta)
    record_max_id(data_dir, top)
    meta[MAX_ID_KEY] = top
    return meta, top
