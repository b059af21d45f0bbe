"""BlockCache: a bounded local directory of fixed-size blocks of store objects, shared by
the ranks and dataloader workers of a host.

A block is written to a temporary file and renamed into place, so a reader sees a block
whole or not at all, and processes filling the same block at once write identical bytes.
Past the size limit the least recently used blocks (by modification time, refreshed on
every hit) are deleted; another process may delete a block just read or about to be, which
only makes the next read of it a miss.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

CACHE_BLOCK_BYTES = 4 << 20
"""Bytes per cached block: one request per block amortises the store's latency (tens of ms)
over a transfer of comparable time, and a window of a few thousand tokens rarely spans two."""
_TRIM_TO = 0.9
"""Eviction frees down to this fraction of the limit, so it runs once per many writes."""


class BlockCache:
    """Blocks of objects under ``directory``, at most about ``max_bytes`` in all.

    ``key`` names one object's content (its URL and content hash, so a rewritten object
    never reads stale blocks); a block is ``directory/key/<index>``.
    """

    def __init__(self, directory: str, max_bytes: int) -> None:
        if max_bytes < CACHE_BLOCK_BYTES:
            raise ValueError(f"a cache of {max_bytes} bytes holds no block of {CACHE_BLOCK_BYTES}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._used: int | None = None  # this process's view, counted on first write

    def get(self, key: str, index: int) -> bytes | None:
        """Block ``index`` of object ``key``, or None when it is not cached."""
        path = self.directory / key / f"{index:010d}"
        try:
            data = path.read_bytes()
        except OSError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # most recently used
        return data

    def has(self, key: str, index: int) -> bool:
        """Whether block ``index`` of object ``key`` is cached (it may be evicted before it
        is read, which only makes that read a miss)."""
        return (self.directory / key / f"{index:010d}").is_file()

    def put(self, key: str, index: int, data: bytes) -> None:
        """Store block ``index`` of ``key``; a full or unwritable cache only skips caching."""
        folder = self.directory / key
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".block-", dir=folder)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, folder / f"{index:010d}")
        except OSError:
            return
        if self._used is None:
            self._used = sum(size for _, size, _ in self._blocks())
        else:
            self._used += len(data)
        if self._used > self.max_bytes:
            self._trim()

    def _blocks(self) -> list[tuple[float, int, Path]]:
        """(last use, size, path) of every block in the cache: O(cached blocks)."""
        found = []
        for folder in self.directory.iterdir():
            if not folder.is_dir():
                continue
            for path in folder.iterdir():
                if path.name.startswith("."):
                    continue
                with contextlib.suppress(OSError):
                    info = path.stat()
                    found.append((info.st_mtime, info.st_size, path))
        return found

    def _trim(self) -> None:
        """Delete the least recently used blocks until the cache is under _TRIM_TO of its
        limit (counted afresh: other processes write and delete here too)."""
        blocks = sorted(self._blocks())
        used = sum(size for _, size, _ in blocks)
        for _, size, path in blocks:
            if used <= self.max_bytes * _TRIM_TO:
                break
            with contextlib.suppress(OSError):
                path.unlink()
            used -= size
        self._used = used
