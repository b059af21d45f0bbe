"""MemoryMappedDataset: fixed-length training windows over a prepared directory's token stream
(its tokens.bin, or its shards' in order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch
from torch.utils.data import Dataset

from kempnerforge.core.errors import DataError
from kempnerforge.data.bad_windows import BadWindowSkipping
from kempnerforge.data.tokens import (
    DTYPES,
    FLAGS_FILE,
    FLAGS_SHA_KEY,
    IGNORE_INDEX,
    TOKENS_FILE,
    StoreReads,
    TokenStream,
    check_token_ids,
    id_limit,
    is_masked,
    masked_targets,
    read_parts,
    token_at_error,
)
from kempnerforge.data.window_values import WindowValues
from kempnerforge.storage.location import join

__all__ = ["IGNORE_INDEX", "MemoryMappedDataset", "SampleDataset"]


class SampleDataset(Protocol):
    """What the training loader and eval read: samples by index, a path naming where they
    come from (for messages), and the bad windows skipped (BadWindowSkipping)."""

    path: str
    skip_windows: frozenset[int]

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]: ...

    def window_for(self, index: int) -> int: ...


class MemoryMappedDataset(BadWindowSkipping, Dataset[dict[str, torch.Tensor]]):
    """Windows of ``seq_len + 1`` tokens at stride ``seq_len`` over a prepared directory.

    Sample ``i`` covers tokens ``[i * seq_len, i * seq_len + seq_len + 1)``; consecutive windows
    share one token, so every token but the first is a label exactly once. Each sample is a
    dict of int64 tensors of shape ``(seq_len,)``:

    - ``input_ids``: the window without its last token; ``labels``: without its first.
    - ``doc_ids``: per input position, the document it belongs to, counted from 0 at the
      window start; an EOS belongs to the document it ends.

    With ``document_masking``, a label that starts a new document (its input is an EOS) is
    IGNORE_INDEX, so nothing is predicted across a boundary, and ``doc_ids`` tells attention
    where the documents are. Data prepared with a BOS per document (``bos_per_document``)
    needs nothing else: the BOS after an EOS is that masked label and the first position of
    its document, and it predicts the document's first token. Without masking, ``doc_ids`` is
    all zeros: the window is one sequence.

    A masked corpus (token_flags.bin beside tokens.bin, see token_flags.py) says itself
    which labels count and where documents end, EOS or not: ``labels`` is IGNORE_INDEX
    where the label's token is not a target and where it opens another document (with or
    without ``document_masking``), and ``doc_ids`` counts the marked document ends. Its
    flags are read with its tokens, window by window, from disk or a store alike.

    ``path`` is a prepared directory or a sharded one (see shards.py): the shards' tokens are one
    stream, in shard order, and a window may span a shard boundary.

    Opening checks meta.json's fields (each shard's), the size of tokens.bin, the tokenizer
    and vocabulary against ``expected_tokenizer`` and ``model_vocab_size``, and the largest
    id meta.json records against both vocabularies, so bad data fails here with a DataError
    naming the file rather than as an IndexError mid-run. No tokens are read: O(shards)
    small reads. Each window read is checked too (the max of its ``seq_len + 1`` ids), so a
    file changed after it was prepared stops the run with a DataError naming the file and
    the offset, not a failed embedding lookup.

    A window listed in ``skip_windows`` (recorded as bad data, see bad_windows.py) is never
    read: its sample is the next window in file order that is not listed.

    ``path`` may be a store URL (s3://, gs://, ...): opening then reads the meta.json
    objects and asks each tokens.bin's size, and windows are read with ranged requests as
    ``store`` says (read-ahead, local cache); the samples are byte-identical to those of
    the same corpus on disk.

    Memory maps (and store readers) are opened lazily and never pickled, so worker
    processes reopen them.
    """

    def __init__(
        self,
        path: str,
        seq_len: int,
        document_masking: bool = True,
        expected_tokenizer: str | None = None,
        model_vocab_size: int | None = None,
        store: StoreReads | None = None,
    ) -> None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.path = path
        self.seq_len = seq_len
        self.document_masking = document_masking
        self.meta, parts = read_parts(path)
        self._check_fits(expected_tokenizer, model_vocab_size)
        for part_dir, part_meta in parts:
            check_token_ids(part_dir, part_meta, model_vocab_size)
        self._model_vocab_size = model_vocab_size
        self._id_limit = id_limit(self.meta, model_vocab_size)
        self.num_tokens = int(self.meta["num_tokens"])
        self.eos_id = int(self.meta["eos_id"])
        self.bos_per_document: bool = self.meta["bos_per_document"]
        self._num_windows = max(self.num_tokens - 1, 0) // seq_len
        if self._num_windows < 1:
            raise DataError(
                f"{path}: {self.num_tokens} tokens, fewer than one window of seq_len + 1 = "
                f"{seq_len + 1}; prepare more text or lower train.seq_len"
            )
        self.content_hashes = [str(part_meta["content_sha256"]) for _, part_meta in parts]
        """Each part's tokens.bin hash, in stream order: what the corpus holds."""
        self._stream = TokenStream(
            [join(part_dir, TOKENS_FILE) for part_dir, _ in parts],
            [int(part_meta["num_tokens"]) for _, part_meta in parts],
            DTYPES[self.meta["dtype"]],
            store,
            self.content_hashes,
        )
        self.window_values: dict[str, WindowValues] = {}
        """Values stored per window, each sample's under its key (0-d float32): a preference
        corpus's stored reference log-probabilities (window_values.py)."""
        self._flags: TokenStream | None = None
        if is_masked(self.meta):  # every shard is, or none (shards.AGREED_KEYS)
            self._flags = TokenStream(
                [join(part_dir, FLAGS_FILE) for part_dir, _ in parts],
                [int(part_meta["num_tokens"]) for _, part_meta in parts],
                np.dtype(np.uint8),
                store,
                [str(part_meta[FLAGS_SHA_KEY]) for _, part_meta in parts],
            )

    def _check_fits(self, expected_tokenizer: str | None, model_vocab_size: int | None) -> None:
        prepared_with = self.meta["tokenizer"]
        if expected_tokenizer is not None and prepared_with != expected_tokenizer:
            raise DataError(
                f"{self.path} was prepared with tokenizer {prepared_with!r}, but this job uses "
                f"{expected_tokenizer!r}; set data.tokenizer to the one that prepared it or "
                "run prepare-data again with this job's tokenizer"
            )
        vocab_size = int(self.meta["vocab_size"])
        if model_vocab_size is not None and vocab_size > model_vocab_size:
            raise DataError(
                f"{self.path} holds ids of a {vocab_size}-token vocabulary, more than the "
                f"model's vocab_size {model_vocab_size}; set model.vocab_size >= {vocab_size}"
            )

    def __len__(self) -> int:
        return self._num_windows

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not 0 <= index < self._num_windows:
            raise IndexError(f"window {index} out of range [0, {self._num_windows})")
        start = self.window_for(index) * self.seq_len
        window = self._stream.read(start, self.seq_len + 1)
        if int(window.max()) >= self._id_limit:
            self._refuse_window(start, window)
        input_ids = window[:-1]
        if self._flags is not None:
            flags = self._flags.read(start, self.seq_len + 1)
            labels, doc_ids = masked_targets(window, flags, self.document_masking)
        else:
            labels, doc_ids = self._eos_targets(window)
        sample = {
            "input_ids": torch.from_numpy(input_ids),
            "labels": torch.from_numpy(labels),
            "doc_ids": torch.from_numpy(doc_ids),
        }
        for key, values in self.window_values.items():
            sample[key] = torch.tensor(values[start // self.seq_len], dtype=torch.float32)
        return sample

    def _eos_targets(self, window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(labels, doc_ids) of an unmasked corpus's window: every label counts, and with
        document masking each EOS ends a document."""
        input_ids = window[:-1]
        labels = window[1:].copy()
        doc_ids = np.zeros(self.seq_len, dtype=np.int64)
        if self.document_masking:
            ends_document = input_ids == self.eos_id
            np.cumsum(ends_document[:-1], out=doc_ids[1:])
            labels[ends_document] = IGNORE_INDEX
        return labels, doc_ids

    def prefetch(self, indices: Sequence[int]) -> None:
        """Fetch the windows of samples ``indices`` together, ahead of reading them: from a
        store, one round of concurrent ranged requests instead of one request per window
        (TokenStream.prefetch); on disk, nothing. The samples read after are the same."""
        in_range = [i for i in indices if 0 <= i < self._num_windows]
        starts = [self.window_for(i) * self.seq_len for i in in_range]
        self._stream.prefetch(starts, self.seq_len + 1)
        if self._flags is not None:
            self._flags.prefetch(starts, self.seq_len + 1)

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The samples of ``indices`` (a batch, as the loader asks for it), prefetched
        together first; the same samples as one ``self[i]`` each."""
        self.prefetch(indices)
        return [self[i] for i in indices]

    def _refuse_window(self, start: int, window: np.ndarray) -> None:
        """Stop on the first id of ``window`` (from stream offset ``start``) beyond the
        vocabulary, naming its file and offset: the file changed after it was prepared, or
        its meta.json understates its largest id."""
        first = int(np.argmax(window >= self._id_limit))
        tokens_path, offset = self._stream.locate(start + first)
        raise token_at_error(
            tokens_path, offset, int(window[first]), self.meta, self._model_vocab_size
        )
