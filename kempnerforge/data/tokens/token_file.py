"""The prepared-data format: tokens.bin (raw little-endian ids) plus meta.json, and its writer.

A prepared directory is complete exactly when meta.json exists: the writer renames tokens.bin
(and a masked corpus's token_flags.bin, see token_flags.py) into place first and meta.json
last, so a crash never leaves a half file under a final name.
meta.json records the largest id written (``max_token_id``), so a reader checks the ids
against a vocabulary without reading tokens.bin.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.data.tokenizer import Tokenizer
from kempnerforge.data.tokens.token_flags import (
    FLAGS_SHA_KEY,
    MASKED_KEY,
    FlagsFileWriter,
    check_flags_file,
    check_loss_mask,
    document_flags,
    flags_meta_problem,
    remove_stale_flags,
)
from kempnerforge.storage.files import (
    is_dir,
    open_for_writing,
    read_text,
    remove,
    size_of,
    write_bytes,
)
from kempnerforge.storage.location import is_store_url, join
from kempnerforge.storage.stores import StoreError

TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
FORMAT_VERSION = 1
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
META_KEYS = (
    "format_version",
    "dtype",
    "vocab_size",
    "num_tokens",
    "num_documents",
    "tokenizer",
    "eos_id",
    "bos_id",
    "content_sha256",
    "sources",
)
# Keys a reader fills in when an older prepared directory lacks them.
META_DEFAULTS: dict[str, Any] = {
    "bos_per_document": False,
    MASKED_KEY: False,
    "format": "text",
    "assistant_tokens": None,  # tokens whose loss is on; None: no mask, every token counts
    "max_document_tokens": None,  # the longest document, BOS and EOS included; None: unknown
}
FORMATS = ("text", "chat", "preference", "prompts")
"""meta.json's ``format``: plain text (every token a target), loss-masked conversations,
preference pairs (a chosen and a rejected response, one window each: prepare/preference.py),
or prompts with their reference answers (one window each: prepare/prompts.py)."""
# The largest id in tokens.bin, -1 when it holds none. Written by every writer since it was
# added; a directory prepared before lacks it until it is scanned once (token_ids.py).
MAX_ID_KEY = "max_token_id"
_FLUSH_TOKENS = 1 << 22  # 4M tokens buffered between writes: 8-16 MB
# Ids are stored as at most uint32, so no vocabulary is larger (2**32).
MAX_VOCAB_SIZE = 1 << 32


def dtype_name_for_vocab(vocab_size: int) -> str:
    """The narrowest stored dtype that holds every id below ``vocab_size``."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def check_distinct_bos(tokenizer: Tokenizer, where: str) -> None:
    """Refuse BOS per document when the tokenizer's BOS is only its EOS standing in.

    A second EOS before each document would read as an empty document: it would split the
    document masking and teach the model to predict an end right after every start.
    """
    if tokenizer.bos_id == tokenizer.eos_id:
        raise DataError(
            f"{where}: tokenizer {tokenizer.identity} has no beginning-of-document token of "
            f"its own (BOS = EOS = id {tokenizer.eos_id}), so documents cannot start with one; "
            "drop the BOS option or use a tokenizer with a BOS token (<s>, <|begin_of_text|>)"
        )


class TokenFileWriter:
    """Streams documents into ``output_dir/tokens.bin``, each followed by EOS and, with
    ``bos_per_document``, preceded by BOS.

    Documents given with a ``loss_mask`` make a masked corpus (``format`` "chat"): no EOS is
    added after them (a chat template's tokens are the whole document), and token_flags.bin
    records each token's mask and where each document ends (token_flags.py). A writer gets a
    mask with every document or with none; ``masked`` says so before the first.

    Use as a context manager: leaving it by an exception removes the temporary file and leaves
    whatever was under the final names before untouched; ``finish`` publishes the result.

    ``output_dir`` may be a store URL: tokens.bin is then uploaded as it is written (the
    store shows the object only once its upload is complete) and meta.json is written after
    it, so there too the corpus is complete exactly when meta.json exists.
    """

    def __init__(
        self,
        output_dir: str,
        tokenizer: Tokenizer,
        bos_per_document: bool = False,
        masked: bool = False,
    ) -> None:
        if bos_per_document:
            check_distinct_bos(tokenizer, output_dir)
        self.output_dir = Path(output_dir)
        self.tokenizer = tokenizer
        self.bos_per_document = bos_per_document
        self.dtype_name = dtype_name_for_vocab(tokenizer.vocab_size)
        self._dtype = DTYPES[self.dtype_name]
        self._eos = np.array([tokenizer.eos_id], dtype=self._dtype)
        self._bos = np.array([tokenizer.bos_id], dtype=self._dtype)
        self._url = output_dir if is_store_url(output_dir) else None
        self._tmp_tokens = self.output_dir / f".{TOKENS_FILE}.tmp-{os.getpid()}"
        self._file: Any
        if self._url is not None:
            self._file = open_for_writing(join(self._url, TOKENS_FILE))
        else:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self._tmp_tokens, "wb")  # noqa: SIM115 (closed by finish or abort)
        self._sha = hashlib.sha256()
        self._buffer: list[np.ndarray] = []
        self._buffered = 0
        self.num_tokens = 0
        self.num_documents = 0
        self.max_token_id = -1  # none written yet
        self.max_document_tokens = 0
        self.assistant_tokens = 0  # tokens whose loss bit is on (a masked corpus)
        # Opened by the first masked document, or now with ``masked``: then even an empty
        # corpus (a shard without conversations) is a masked one, like its sibling shards.
        self._flags: FlagsFileWriter | None = None
        if masked:
            self._flags = FlagsFileWriter(str(self.output_dir), self._url)
        self._flag_buffer: list[np.ndarray] = []

    def add_document(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None) -> None:
        """Append one document's ids and its EOS (after its BOS, with bos_per_document).

        With ``loss_mask`` (bool, one per token, True where the token is a supervised
        target), no EOS is added and the mask goes to token_flags.bin; a BOS added before
        the document is never a target.
        """
        self._check_mask(tokens, loss_mask)
        pieces = [self._bos] if self.bos_per_document else []
        pieces.append(tokens)
        if loss_mask is None:
            pieces.append(self._eos)
        length = sum(len(piece) for piece in pieces)
        if loss_mask is not None:
            if self.bos_per_document:
                loss_mask = np.concatenate([np.zeros(1, dtype=bool), loss_mask])
            self._flag_buffer.append(document_flags(loss_mask, length))
            self.assistant_tokens += int(np.count_nonzero(loss_mask))
        self._buffer.extend(pieces)
        self._buffered += length
        self.max_document_tokens = max(self.max_document_tokens, length)
        self.num_documents += 1
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def add_padding(self, num_tokens: int) -> None:
        """Append ``num_tokens`` pad ids (the tokenizer's pad id, its EOS when it has none)
        as a run of a loss-masked corpus that is never a target and ends a document, so no
        attention crosses it: the unused rest of a packed window (data/chat/packing.py). Not counted
        as a document, nor in max_document_tokens."""
        if self._flags is None:
            if self.num_documents:
                raise ValueError(f"{self.output_dir}: padding goes only into a masked corpus")
            self._flags = FlagsFileWriter(str(self.output_dir), self._url)
        self._buffer.append(np.full(num_tokens, self.tokenizer.pad_id, dtype=np.int64))
        self._flag_buffer.append(document_flags(np.zeros(num_tokens, dtype=bool), num_tokens))
        self._buffered += num_tokens
        if self._buffered >= _FLUSH_TOKENS:
            self._flush()

    def _check_mask(self, tokens: np.ndarray, loss_mask: np.ndarray | None) -> None:
        """The first document decides whether the corpus is masked (opening
        token_flags.bin then); every later one must agree (check_loss_mask)."""
        if self.num_documents == 0 and loss_mask is not None and self._flags is None:
            self._flags = FlagsFileWriter(str(self.output_dir), self._url)
        check_loss_mask(
            f"{self.output_dir}: document {self.num_documents}",
            tokens,
            loss_mask,
            self._flags is not None,
            self.bos_per_document,
        )

    def _flush(self) -> None:
        if not self._buffer:
            return
        ids = np.concatenate(self._buffer)
        top = int(ids.max()) if ids.size else -1
        if top >= self.tokenizer.vocab_size:
            # A cast would wrap such an id silently into a different token.
            raise ValueError(
                f"tokenizer {self.tokenizer.identity} produced id {top} "
                f">= its vocab_size {self.tokenizer.vocab_size}"
            )
        self.max_token_id = max(self.max_token_id, top)
        data = ids.astype(self._dtype, copy=False).tobytes()
        self._file.write(data)
        self._sha.update(data)
        self.num_tokens += self._buffered
        self._buffer.clear()
        self._buffered = 0
        if self._flags is not None:
            self._flags.write(np.concatenate(self._flag_buffer))
            self._flag_buffer.clear()

    def finish(self, num_sources: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """Publish tokens.bin and meta.json (with the fields of ``extra`` added, e.g. a
        packed corpus's); returns the metadata written."""
        self._flush()
        if self._url is None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        if self._flags is not None:
            self._flags.sync()
        meta = {
            "format_version": FORMAT_VERSION,
            "dtype": self.dtype_name,
            "vocab_size": self.tokenizer.vocab_size,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            MAX_ID_KEY: self.max_token_id,
            "tokenizer": self.tokenizer.identity,
            "eos_id": self.tokenizer.eos_id,
            "bos_id": self.tokenizer.bos_id,
            "bos_per_document": self.bos_per_document,
            "content_sha256": self._sha.hexdigest(),
            "sources": num_sources,
            "format": "chat" if self._flags is not None else "text",
            MASKED_KEY: self._flags is not None,
            "assistant_tokens": self.assistant_tokens if self._flags is not None else None,
            "max_document_tokens": self.max_document_tokens,
        }
        meta.update(extra or {})
        if self._flags is not None:
            meta[FLAGS_SHA_KEY] = self._flags.sha256
        if self._url is not None:
            self._publish_to_store(meta, self._url)
            return meta
        meta_path = self.output_dir / META_FILE
        # Drop the old meta.json first: new tokens beside old metadata must never look complete.
        meta_path.unlink(missing_ok=True)
        os.replace(self._tmp_tokens, self.output_dir / TOKENS_FILE)
        self._publish_flags(str(self.output_dir))
        tmp_meta = self.output_dir / f".{META_FILE}.tmp-{os.getpid()}"
        tmp_meta.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        os.replace(tmp_meta, meta_path)
        return meta

    def _publish_to_store(self, meta: dict[str, Any], url: str) -> None:
        """meta.json removed, tokens.bin's upload completed, then meta.json written: a reader
        never finds new tokens beside old metadata, nor meta.json before its tokens."""
        remove(join(url, META_FILE))
        self._file.close()
        self._publish_flags(url)
        write_bytes(join(url, META_FILE), (json.dumps(meta, indent=2) + "\n").encode("utf-8"))

    def _publish_flags(self, output_dir: str) -> None:
        """token_flags.bin into place, or an old one removed: after tokens.bin, before
        meta.json, so a complete directory's flags always describe its tokens."""
        if self._flags is not None:
            self._flags.publish()
        else:
            remove_stale_flags(output_dir)

    def abort(self) -> None:
        """Close and delete the temporary files, or abandon the uploads (safe to call more
        than once)."""
        if self._flags is not None:
            self._flags.abort()
        if self._url is not None:
            self._file.discard()
            return
        if not self._file.closed:
            self._file.close()
        self._tmp_tokens.unlink(missing_ok=True)

    def __enter__(self) -> TokenFileWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        if exc_type is not None:
            self.abort()


def read_meta(data_dir: str) -> dict[str, Any]:
    """meta.json of a prepared directory (a local path or a store URL), checked for the keys
    and values this format needs."""
    path = join(data_dir, META_FILE)
    hint = "run `kempnerforge prepare-data --input ... --output DIR` and point at DIR"
    if size_of(path) is None:
        what = "is not a directory" if not is_dir(data_dir) else f"has no {META_FILE}"
        raise DataError(f"{data_dir} {what}: it is not a prepared data directory; {hint}")
    try:
        meta = json.loads(read_text(path))
    except StoreError:
        raise
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as JSON ({exc}); {hint} again") from None
    if not isinstance(meta, dict):
        raise DataError(f"{path}: expected a JSON object; {hint} again")
    missing = [key for key in META_KEYS if key not in meta]
    if missing:
        raise DataError(f"{path}: missing {', '.join(missing)}; {hint} again")
    for key, default in META_DEFAULTS.items():
        meta.setdefault(key, default)
    problem = meta_problem(meta)
    if problem is not None:
        raise DataError(f"{path}: {problem}; {hint} again")
    return meta


def meta_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the values of a meta.json holding every key, or None.

    Each field must have the type and range the writer gives it; the first that does not is
    named with its value and what it should be.
    """
    version = meta["format_version"]
    if not _is_int(version) or version != FORMAT_VERSION:
        return f"format_version {_show(version)}, this version reads {FORMAT_VERSION}"
    dtype = meta["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        return f"dtype {_show(dtype)} is not one of {', '.join(DTYPES)}"
    vocab_size = meta["vocab_size"]
    if not (_is_int(vocab_size) and 1 <= vocab_size <= MAX_VOCAB_SIZE):
        return f"vocab_size {_show(vocab_size)} is not an integer in [1, 2**32]"
    for key in ("num_tokens", "num_documents", "sources"):
        if not (_is_int(meta[key]) and meta[key] >= 0):
            return f"{key} {_show(meta[key])} is not an integer >= 0"
    for key in ("eos_id", "bos_id"):
        value = meta[key]
        if not (_is_int(value) and 0 <= value < vocab_size):
            return f"{key} {_show(value)} is not an id of the vocabulary, [0, {vocab_size})"
    for key in ("tokenizer", "content_sha256"):
        if not (isinstance(meta[key], str) and meta[key]):
            return f"{key} {_show(meta[key])} is not a non-empty string"
    if not isinstance(meta["bos_per_document"], bool):
        return f"bos_per_document {_show(meta['bos_per_document'])} is not true or false"
    if meta["format"] not in FORMATS:
        return f"format {_show(meta['format'])} is not one of {', '.join(FORMATS)}"
    return flags_meta_problem(meta) or _max_id_problem(meta)


def _max_id_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with an optional max_token_id: an id, -1 exactly when there are no tokens.

    Whether it lies below vocab_size is the opening check's question, not the format's: its
    message says what an id beyond the vocabulary means.
    """
    if MAX_ID_KEY not in meta:
        return None
    top = meta[MAX_ID_KEY]
    if not (_is_int(top) and -1 <= top < MAX_VOCAB_SIZE):
        return f"{MAX_ID_KEY} {_show(top)} is not an integer in [-1, 2**32)"
    if (top == -1) != (meta["num_tokens"] == 0):
        return (
            f"{MAX_ID_KEY} {top} does not fit num_tokens {meta['num_tokens']} "
            "(it is -1 exactly when there are no tokens)"
        )
    return None


def _is_int(value: Any) -> bool:
    # JSON true / false load as bool, an int subclass; only bos_per_document is a bool.
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """``repr(value)``, shortened: a message stays one readable line."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_tokens_file(data_dir: str, meta: dict[str, Any]) -> str:
    """Path (or URL) of tokens.bin after checking its size matches meta.json's count and
    dtype, and a masked corpus's token_flags.bin one byte per token; no content is read (a
    stat, or one metadata request to a store per file)."""
    path = join(data_dir, TOKENS_FILE)
    actual = size_of(path)
    if actual is None:
        raise DataError(f"{path} is missing although meta.json exists; run prepare-data again")
    itemsize = DTYPES[meta["dtype"]].itemsize
    expected = int(meta["num_tokens"]) * itemsize
    if actual != expected:
        raise DataError(
            f"{path} is {actual} bytes but meta.json says {meta['num_tokens']} tokens of "
            f"{meta['dtype']} = {expected} bytes: the file is truncated or the dtype is wrong; "
            "run prepare-data again"
        )
    check_flags_file(data_dir, meta)
    return path


def is_complete(data_dir: str) -> bool:
    """Whether ``data_dir`` holds a finished, size-consistent prepared corpus."""
    try:
        check_tokens_file(data_dir, read_meta(data_dir))
    except DataError:
        return False
    return True
