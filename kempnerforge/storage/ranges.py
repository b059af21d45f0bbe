"""RangeReader: byte ranges of one store object, read with ranged requests, a read-ahead for
sequential reads and, optionally, a local block cache.

Training windows come in a shuffled order, so most reads are far from the one before: each is
one request for exactly its bytes (reading ahead would fetch megabytes to use kilobytes).
Reads that move forward through the object (evaluation, ``data.shuffle = false``, the next
window of a batch) fetch ``read_ahead`` bytes at once and serve the following reads from
memory, so the store's latency is paid once per block instead of once per window. With a
BlockCache every read goes by whole cache blocks, kept on local disk for later epochs.

``prefetch`` fetches the ranges a batch is about to read, of any number of readers, in one
round of concurrent requests (read_ranges), so a batch of shuffled windows waits for the
store about once instead of once per window.
"""

from __future__ import annotations

from collections.abc import Sequence

from kempnerforge.storage.cache import CACHE_BLOCK_BYTES, BlockCache
from kempnerforge.storage.files import read_range, read_ranges


class RangeReader:
    """Bytes of the object at ``url`` (``size`` bytes, known from meta.json).

    Holds the URL and at most one read-ahead buffer, never a connection: after a fork or
    pickling, reads go through the new process's own filesystem (stores.filesystem).
    ``cache_key`` names the object's content in ``cache``.
    """

    def __init__(
        self,
        url: str,
        size: int,
        read_ahead: int,
        cache: BlockCache | None = None,
        cache_key: str = "",
    ) -> None:
        self.url = url
        self.size = size
        self.read_ahead = read_ahead
        self.cache = cache
        self.cache_key = cache_key
        self._buffer = b""
        self._buffer_start = 0
        self._last = (-1, -1)  # the byte range of the previous read
        self._prefetched: dict[tuple[int, int], bytes] = {}  # ranges fetched ahead, by prefetch
        self.requests = 0  # ranged requests sent by this reader (for benchmarks and tests)

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of the object."""
        if not 0 <= start <= end <= self.size:
            raise IndexError(f"{self.url}: bytes [{start}, {end}) beyond its {self.size}")
        if start == end:
            return b""
        ahead = self._prefetched.pop((start, end), None)
        if ahead is not None:
            self._last = (start, end)
            return ahead
        if self.cache is not None:
            return self._read_cached(start, end)
        buffered_end = self._buffer_start + len(self._buffer)
        if self._buffer_start <= start and end <= buffered_end:
            data = self._buffer[start - self._buffer_start : end - self._buffer_start]
        elif self.read_ahead > 0 and self._last[0] < start <= self._last[1]:
            # Moving forward from the previous read: fetch a whole read-ahead block.
            stop = min(self.size, max(end, start + self.read_ahead))
            self._buffer, self._buffer_start = self._fetch(start, stop), start
            data = self._buffer[: end - start]
        else:
            data = self._fetch(start, end)
        self._last = (start, end)
        return data

    def _fetch(self, start: int, end: int) -> bytes:
        self.requests += 1
        return read_range(self.url, start, end)

    def wanted(self, start: int, end: int) -> list[tuple[int, int]]:
        """The byte ranges a read of ``[start, end)`` would fetch from the store: itself, or
        the cache blocks it covers that are not cached; none when it is buffered."""
        if self.cache is None:
            buffered_end = self._buffer_start + len(self._buffer)
            inside = self._buffer_start <= start and end <= buffered_end
            return [] if inside or start == end else [(start, end)]
        ranges = []
        for index in range(start // CACHE_BLOCK_BYTES, (end - 1) // CACHE_BLOCK_BYTES + 1):
            if not self.cache.has(self.cache_key, index):
                block_start = index * CACHE_BLOCK_BYTES
                ranges.append((block_start, min(self.size, block_start + CACHE_BLOCK_BYTES)))
        return ranges

    def keep(self, start: int, end: int, data: bytes) -> None:
        """Hold bytes ``[start, end)`` fetched for a read about to come (or cache the block)."""
        if self.cache is not None:
            self.cache.put(self.cache_key, start // CACHE_BLOCK_BYTES, data)
        else:
            self._prefetched[(start, end)] = data

    def _read_cached(self, start: int, end: int) -> bytes:
        assert self.cache is not None
        pieces = []
        for index in range(start // CACHE_BLOCK_BYTES, (end - 1) // CACHE_BLOCK_BYTES + 1):
            block_start = index * CACHE_BLOCK_BYTES
            block = self.cache.get(self.cache_key, index)
            if block is None:
                block = self._fetch(block_start, min(self.size, block_start + CACHE_BLOCK_BYTES))
                self.cache.put(self.cache_key, index, block)
            lo = max(start, block_start) - block_start
            hi = min(end, block_start + len(block)) - block_start
            pieces.append(block[lo:hi])
        return b"".join(pieces)

    def __getstate__(self) -> dict[str, object]:
        # A worker starts without the parent's buffer (it reads other windows).
        state = self.__dict__.copy()
        state["_buffer"], state["_buffer_start"], state["_last"] = b"", 0, (-1, -1)
        state["_prefetched"] = {}
        return state


def prefetch(reads: Sequence[tuple[RangeReader, int, int]]) -> None:
    """Fetch what the reads ``(reader, start, end)`` about to come need from the store, in
    one round of concurrent requests; each reader then serves its read from memory (or its
    cache). Ranges fetched ahead and never read are dropped at the reader's next prefetch,
    so a reader holds at most one batch of them."""
    fetches: dict[tuple[int, int, int], RangeReader] = {}
    for reader, _, _ in reads:
        reader._prefetched.clear()
    for reader, start, end in reads:
        for lo, hi in reader.wanted(start, end):
            fetches.setdefault((id(reader), lo, hi), reader)
    if not fetches:
        return
    keys = list(fetches)
    readers = [fetches[key] for key in keys]
    datas = read_ranges([r.url for r in readers], [k[1] for k in keys], [k[2] for k in keys])
    for reader, (_, lo, hi), data in zip(readers, keys, datas, strict=True):
        reader.requests += 1
        reader.keep(lo, hi, data)
