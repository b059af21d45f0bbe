"""Token files in an object store, read like memory maps: StoreTokens slices into numpy ids
through a RangeReader, so TokenStream and the datasets above it have one code path for a
corpus on disk and one in a store, and read the same bytes from either."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np

from kempnerforge.storage.cache import BlockCache
from kempnerforge.storage.ranges import RangeReader

STORE_CACHE_SUBDIR = "store"
"""The block cache's directory inside data.cache_dir (beside the built-in corpus)."""


@dataclass(frozen=True)
class StoreReads:
    """How token files in a store are read: ``read_ahead_bytes`` fetched at once when reads
    move forward through a file, and a local block cache of ``cache_bytes`` (0: none) under
    ``cache_dir``. Holds no connection, so it pickles to loader workers as it is."""

    read_ahead_bytes: int = 8 << 20
    cache_dir: str = ""
    cache_bytes: int = 0

    def cache(self) -> BlockCache | None:
        """The block cache these settings ask for, or None."""
        if self.cache_bytes <= 0:
            return None
        return BlockCache(os.path.join(self.cache_dir, STORE_CACHE_SUBDIR), self.cache_bytes)


def cache_key(url: str, content_id: str) -> str:
    """The cache's name for the object at ``url`` holding content ``content_id`` (meta.json's
    content_sha256): a corpus prepared again under the same URL never reads stale blocks."""
    return hashlib.sha256(f"{url}\n{content_id}".encode()).hexdigest()[:32]


class StoreTokens:
    """The ``size`` ids of dtype ``dtype`` in the object at ``url``, sliced like an array.

    ``ids[a:b]`` is one RangeReader read of bytes ``[a, b) * itemsize``; nothing is read
    on creation.
    """

    def __init__(
        self,
        url: str,
        size: int,
        dtype: np.dtype,
        reads: StoreReads,
        cache: BlockCache | None,
        content_id: str,
    ) -> None:
        self.dtype = dtype
        self._size = size
        self.reader = RangeReader(
            url,
            size * dtype.itemsize,
            reads.read_ahead_bytes,
            cache,
            cache_key(url, content_id),
        )

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: slice) -> np.ndarray:
        start, stop, step = index.indices(self._size)
        if step != 1:
            raise IndexError("token files in a store are read in contiguous slices")
        stop = max(start, stop)
        item = self.dtype.itemsize
        return np.frombuffer(self.reader.read(start * item, stop * item), dtype=self.dtype)
