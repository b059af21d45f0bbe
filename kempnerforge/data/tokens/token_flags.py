"""The per-token flags of a masked corpus (token_flags.bin, one uint8 per token beside
tokens.bin): which tokens are supervised targets and where documents end, and the labels and
document ids a window's flags give.

Chat templates emit EOS inside a conversation, so a masked corpus marks its document ends
explicitly instead of letting a reader infer them from EOS.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np

from kempnerforge.core.errors import DataError
from kempnerforge.storage.files import open_for_writing, remove, size_of
from kempnerforge.storage.location import join

FLAGS_FILE = "token_flags.bin"
LOSS_ON = 1
"""Bit 0: this token is a supervised target (its loss counts when it is a label)."""
ENDS_DOCUMENT = 2
"""Bit 1: this token is the last of its document; the next token starts another."""
IGNORE_INDEX = -100
"""The label of a position whose loss is not counted (the loss's ignore_index)."""
MASKED_KEY = "loss_mask"
"""meta.json's key saying the directory is a masked corpus (token_flags.bin exists)."""
FLAGS_SHA_KEY = "token_flags_sha256"
"""meta.json's key holding token_flags.bin's content hash, like content_sha256 for tokens."""
PACKED_COUNTS = (
    "pad_tokens",
    "conversations_cut",
    "conversations_dropped",
    "conversations_refused",
)
"""meta.json's counts of a chat corpus (its packing into windows, and the conversations left
out as refused), summed over shards."""


def document_flags(loss_mask: np.ndarray, num_tokens: int) -> np.ndarray:
    """The flags of one document's ``num_tokens`` tokens: LOSS_ON where ``loss_mask`` is
    True, ENDS_DOCUMENT on the last token."""
    flags = np.where(np.asarray(loss_mask, dtype=bool), LOSS_ON, 0).astype(np.uint8)
    flags[num_tokens - 1] |= ENDS_DOCUMENT
    return flags


def check_loss_mask(
    where: str,
    tokens: np.ndarray,
    loss_mask: np.ndarray | None,
    masked_corpus: bool,
    bos_per_document: bool,
) -> None:
    """Refuse, naming ``where`` (the corpus and document), a ``loss_mask`` given to a
    corpus of unmasked documents or missing in a masked one, one that is not a bool per
    token, or an empty masked document (no token would mark its end)."""
    if (loss_mask is not None) != masked_corpus:
        given, first = ("a", "without") if loss_mask is not None else ("no", "with")
        raise ValueError(
            f"{where} came with {given} loss_mask but the first came {first} one: a corpus "
            "is loss-masked in every document or in none; give every document a mask, or none"
        )
    if loss_mask is None:
        return
    if loss_mask.dtype != np.bool_ or loss_mask.shape != (len(tokens),):
        raise ValueError(
            f"{where}: loss_mask is {loss_mask.dtype} of shape {loss_mask.shape}; expected "
            f"bool of shape ({len(tokens)},), one per token"
        )
    if len(tokens) == 0 and not bos_per_document:
        raise ValueError(
            f"{where} is empty, and a masked document needs a token to mark its end; leave "
            "empty documents out"
        )


def masked_targets(
    window: np.ndarray, flags: np.ndarray, document_masking: bool
) -> tuple[np.ndarray, np.ndarray]:
    """(labels, doc_ids) of a window of ``seq_len + 1`` ids of a masked corpus and their flags.

    ``labels[i]`` is ``window[i + 1]`` where that token is a target, else IGNORE_INDEX; a label
    that opens another document is IGNORE_INDEX even without ``document_masking``, since one
    conversation never predicts the next. ``doc_ids`` counts the document ends before each
    input position when ``document_masking`` is on, and is all zeros otherwise.
    """
    labels = window[1:].copy()
    labels[(flags[1:] & LOSS_ON) == 0] = IGNORE_INDEX
    ends_document = (flags[:-1] & ENDS_DOCUMENT) != 0
    labels[ends_document] = IGNORE_INDEX
    doc_ids = np.zeros(len(labels), dtype=np.int64)
    if document_masking:
        np.cumsum(ends_document[:-1], out=doc_ids[1:])
    return labels, doc_ids


def is_masked(meta: dict[str, Any]) -> bool:
    """Whether the prepared directory of ``meta`` (a meta.json) is a masked corpus."""
    return bool(meta.get(MASKED_KEY, False))


def check_flags_file(data_dir: str, meta: dict[str, Any]) -> str | None:
    """Path (or URL) of token_flags.bin when ``meta`` says the corpus is masked, after
    checking it holds one byte per token; None for an unmasked corpus. No content is read."""
    if not is_masked(meta):
        return None
    path = join(data_dir, FLAGS_FILE)
    actual = size_of(path)
    if actual is None:
        raise DataError(
            f"{path} is missing although meta.json says the corpus is loss-masked; run "
            "prepare-data again"
        )
    if actual != int(meta["num_tokens"]):
        raise DataError(
            f"{path} is {actual} bytes but meta.json says {meta['num_tokens']} tokens, one "
            "flag byte each: the file is truncated; run prepare-data again"
        )
    return path


def flags_meta_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the mask fields of a meta.json (defaults filled in), or None."""
    if not isinstance(meta[MASKED_KEY], bool):
        return f"{MASKED_KEY} {meta[MASKED_KEY]!r} is not true or false"
    if meta[MASKED_KEY] and not (isinstance(meta.get(FLAGS_SHA_KEY), str) and meta[FLAGS_SHA_KEY]):
        return f"{MASKED_KEY} is true but {FLAGS_SHA_KEY} is not a non-empty string"
    for key in ("assistant_tokens", "max_document_tokens", *PACKED_COUNTS):
        value = meta.get(key)
        if value is not None and not (type(value) is int and value >= 0):
            return f"{key} {value!r} is not an integer >= 0 or null"
    packed = meta.get("packed_seq_len")
    if packed is not None and not (type(packed) is int and packed >= 1):
        return f"packed_seq_len {packed!r} is not an integer >= 1 or null"
    return None


class FlagsFileWriter:
    """token_flags.bin of a corpus being written: a temporary file in ``output_dir`` that
    ``publish`` renames into place, or, when ``url`` is a store URL, an upload that
    ``publish`` completes (the store shows the object only then). ``sha256`` is the hash of
    what was written."""

    def __init__(self, output_dir: str, url: str | None) -> None:
        self._url = url
        self._dir = Path(output_dir)
        self._tmp = self._dir / f".{FLAGS_FILE}.tmp-{os.getpid()}"
        self._file: Any
        if url is not None:
            self._file = open_for_writing(join(url, FLAGS_FILE))
        else:
            self._file = open(self._tmp, "wb")  # noqa: SIM115 (closed by publish or abort)
        self._sha = hashlib.sha256()

    @property
    def sha256(self) -> str:
        return self._sha.hexdigest()

    def write(self, flags: np.ndarray) -> None:
        data = flags.astype(np.uint8, copy=False).tobytes()
        self._file.write(data)
        self._sha.update(data)

    def sync(self) -> None:
        """Make a local file durable before its rename (a store upload needs nothing)."""
        if self._url is None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def publish(self) -> None:
        """Put token_flags.bin under its final name; meta.json must be written after."""
        if self._url is not None:
            self._file.close()
        else:
            os.replace(self._tmp, self._dir / FLAGS_FILE)

    def abort(self) -> None:
        """Drop the temporary file or the upload (safe to call more than once)."""
        if self._url is not None:
            self._file.discard()
            return
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def remove_stale_flags(output_dir: str) -> None:
    """Delete a token_flags.bin left by an earlier masked corpus in ``output_dir``: an
    unmasked corpus written over it must not keep a flags file that describes other tokens."""
    remove(join(output_dir, FLAGS_FILE))
