"""TokenStream: the tokens.bin files of a prepared directory (one, or one per shard) read as
one stream of ids, through a small cache of memory maps (or, for files in an object store,
of StoreTokens readers)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from kempnerforge.data.tokens.store_tokens import StoreReads, StoreTokens
from kempnerforge.storage.location import is_store_url, local_path
from kempnerforge.storage.ranges import RangeReader, prefetch

# Memory maps kept open per process: a window spans few files, and a corpus of thousands of
# shards must not hold thousands of maps (each a kernel mapping) in every loader worker.
MAX_OPEN_MAPS = 8


class TokenStream:
    """Ids ``[0, num_tokens)`` of several token files laid end to end, in the order given.

    Holds a path and an offset per file, O(files) memory. Maps are opened on first read and
    the least recently used is closed beyond MAX_OPEN_MAPS; none survive pickling, so a
    loader worker opens its own. A path that is a store URL is read through StoreTokens as
    ``store`` says (read-ahead, cache); ``content_ids`` (each file's content_sha256) name
    its content in the cache.
    """

    def __init__(
        self,
        paths: Sequence[str],
        sizes: Sequence[int],
        dtype: np.dtype,
        store: StoreReads | None = None,
        content_ids: Sequence[str] | None = None,
    ) -> None:
        if len(paths) != len(sizes) or not paths:
            raise ValueError(f"need one size per file, got {len(paths)} paths, {len(sizes)} sizes")
        self.paths = list(paths)
        self.dtype = dtype
        self.store = store or StoreReads()
        self.content_ids = list(content_ids) if content_ids is not None else [""] * len(paths)
        self._cache = self.store.cache()
        # starts[i] is the stream offset of file i's first id; starts[-1] is the total.
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64)
        self._maps: OrderedDict[int, np.ndarray | StoreTokens] = OrderedDict()

    @property
    def num_tokens(self) -> int:
        return int(self.starts[-1])

    def _file_of(self, offset: int) -> int:
        """The file holding stream offset ``offset`` (never an empty file)."""
        return int(np.searchsorted(self.starts, offset, side="right")) - 1

    def locate(self, offset: int) -> tuple[str, int]:
        """(file, offset in that file) of stream offset ``offset``."""
        index = self._file_of(offset)
        return self.paths[index], offset - int(self.starts[index])

    def read(self, start: int, length: int) -> np.ndarray:
        """Ids ``[start, start + length)`` as int64, across file boundaries."""
        if not (start >= 0 and length >= 0 and start + length <= self.num_tokens):
            raise IndexError(f"ids [{start}, {start + length}) beyond [0, {self.num_tokens})")
        index = self._file_of(start)
        first = self._map(index)
        local = start - int(self.starts[index])
        if local + length <= len(first):  # the common case: one file
            return np.asarray(first[local : local + length], dtype=np.int64)
        pieces = []
        while length > 0:
            ids = self._map(index)
            piece = ids[local : local + length]
            pieces.append(np.asarray(piece, dtype=np.int64))
            length -= len(piece)
            index, local = index + 1, 0
        return np.concatenate(pieces)

    def prefetch(self, starts: Sequence[int], length: int) -> None:
        """Fetch ids ``[start, start + length)`` for every start at once, for the reads
        about to come: the ranged requests of the files in a store go out together (one
        round trip for a batch of shuffled windows, not one per window); memory-mapped
        files need nothing. Reads return the same ids with or without it."""
        reads: list[tuple[RangeReader, int, int]] = []
        for start in starts:
            index = self._file_of(start)
            local, remaining = start - int(self.starts[index]), length
            while remaining > 0 and index < len(self.paths):
                ids = self._map(index)
                take = min(remaining, len(ids) - local)
                if isinstance(ids, StoreTokens) and take > 0:
                    item = self.dtype.itemsize
                    reads.append((ids.reader, local * item, (local + take) * item))
                remaining -= take
                index, local = index + 1, 0
        if reads:
            prefetch(reads)

    def _map(self, index: int) -> np.ndarray | StoreTokens:
        ids = self._maps.get(index)
        if ids is not None:
            self._maps.move_to_end(index)
            return ids
        size = int(self.starts[index + 1] - self.starts[index])
        if size == 0:  # numpy cannot map an empty file; a read only passes over it
            return np.zeros(0, dtype=self.dtype)
        path = self.paths[index]
        if is_store_url(path):
            ids = StoreTokens(
                path, size, self.dtype, self.store, self._cache, self.content_ids[index]
            )
        else:
            ids = np.memmap(local_path(path), dtype=self.dtype, mode="r", shape=(size,))
        self._maps[index] = ids
        if len(self._maps) > MAX_OPEN_MAPS:
            self._maps.popitem(last=False)
        return ids

    def __getstate__(self) -> dict[str, Any]:
        # A memory map does not survive pickling to a worker; the worker reopens the files
        # (and a store reader its connection, in its own process).
        state = self.__dict__.copy()
        state["_maps"] = OrderedDict()
        return state
