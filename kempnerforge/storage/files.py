"""The few file operations a prepared corpus needs, for a local path and a store URL alike,
so the readers and writers of data/ have one code path for both."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kempnerforge.storage.deadlines import Deadline
from kempnerforge.storage.location import base_name, is_store_url, local_path
from kempnerforge.storage.stores import StoreError, store_call, store_error


def size_of(path: str) -> int | None:
    """Size in bytes of the file or object at ``path``; None when there is none (or it is a
    directory). Reads no content: a stat, or one metadata request to the store."""
    if not is_store_url(path):
        local = Path(local_path(path))
        return local.stat().st_size if local.is_file() else None

    def size(fs: Any, key: str) -> int | None:
        try:
            info = fs.info(key)
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    return store_call(path, size)


def read_text(path: str) -> str:
    """The whole content of the UTF-8 file or object at ``path`` (a small one, such as
    meta.json); a UnicodeDecodeError when it is not UTF-8."""
    if not is_store_url(path):
        return Path(local_path(path)).read_text(encoding="utf-8")
    return store_call(path, lambda fs, key: fs.cat_file(key)).decode("utf-8")


def read_range(url: str, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of the object at ``url``: one ranged request."""
    data = store_call(url, lambda fs, key: fs.cat_file(key, start=start, end=end))
    return _whole(url, start, end, data)


def _whole(url: str, start: int, end: int, data: bytes) -> bytes:
    """``data``, checked to be all of bytes ``[start, end)`` of ``url``."""
    if len(data) != end - start:
        raise StoreError(
            f"{url}: asked for bytes [{start}, {end}), the store returned {len(data)}: the "
            "object is shorter than its meta.json says; prepare the corpus again"
        )
    return data


def read_ranges(urls: list[str], starts: list[int], ends: list[int]) -> list[bytes]:
    """Bytes ``[starts[i], ends[i])`` of each object ``urls[i]``, all asked for at once:
    the clients of S3 and GCS are asynchronous and send the requests together, so a batch
    of windows costs about one round trip to the store instead of one per window."""
    found: list[bytes | None] = [None] * len(urls)
    by_store: dict[str, list[int]] = {}
    for i, url in enumerate(urls):
        by_store.setdefault(url.split("://", 1)[0], []).append(i)
    for positions in by_store.values():
        first = urls[positions[0]]

        def fetch(fs: Any, _: str, positions: list[int] = positions) -> list[bytes]:
            return fs.cat_ranges(
                [fs._strip_protocol(urls[i]) for i in positions],
                [starts[i] for i in positions],
                [ends[i] for i in positions],
                on_error="raise",
            )

        for i, data in zip(positions, store_call(first, fetch), strict=True):
            found[i] = _whole(urls[i], starts[i], ends[i], data)
    return [data for data in found if data is not None]  # every position is filled


def is_dir(path: str) -> bool:
    """Whether ``path`` is a directory (in a store: a prefix holding objects, or a bucket)."""
    if not is_store_url(path):
        return Path(local_path(path)).is_dir()
    return store_call(path, lambda fs, key: bool(fs.isdir(key)))


def names_in(path: str) -> list[str]:
    """Names of the entries directly inside directory ``path`` (one listing in a store)."""
    if not is_store_url(path):
        return [entry.name for entry in Path(local_path(path)).iterdir()]

    def names(fs: Any, key: str) -> list[str]:
        try:
            return [base_name(str(p)) for p in fs.ls(key, detail=False)]
        except FileNotFoundError:
            return []

    return store_call(path, names)


def probe(url: str) -> None:
    """Ask the store for the listing of ``url`` once: a missing bucket or directory, refused
    credentials or an unreachable endpoint raise StoreError with the store's own error."""

    def listing(fs: Any, key: str) -> None:
        try:
            found = fs.ls(key, detail=False)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"nothing is stored under {url}: {exc}") from None
        if not found:
            raise FileNotFoundError(f"nothing is stored under {url}")

    store_call(url, listing)


def remove(path: str, *, deadline: Deadline | None = None) -> None:
    """Delete the file or object at ``path`` if it exists (in a store, by ``deadline``)."""
    if not is_store_url(path):
        Path(local_path(path)).unlink(missing_ok=True)
        return

    def delete(fs: Any, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            fs.rm_file(key)

    store_call(path, delete, deadline=deadline)


def write_bytes(url: str, data: bytes, *, deadline: Deadline | None = None) -> None:
    """Store ``data`` as the object ``url`` by ``deadline``; it appears whole or not at all."""
    store_call(url, lambda fs, key: fs.pipe_file(key, data), deadline=deadline)


def write_file(path: str, write: Callable[[str], None]) -> None:
    """Have ``write(local path)`` write the file ``path``: a local path as it is; a store
    URL through a temporary local file, then uploaded (the object appears whole or not at
    all)."""
    if not is_store_url(path):
        write(local_path(path))
        return
    with tempfile.TemporaryDirectory(prefix="kempnerforge-out-") as tmp:
        local = os.path.join(tmp, base_name(path))
        write(local)
        store_call(path, lambda fs, key: fs.put_file(local, key))


def open_for_writing(url: str) -> Any:
    """A binary file writing the object ``url``: uploaded in parts, the object exists only
    once ``close`` has finished, and ``discard`` drops it (see ObjectWriter)."""
    return ObjectWriter(url)


class ObjectWriter:
    """A file-like writer of one store object: ``write``, ``close`` (publish) or ``discard``.

    The store makes an object visible only when its upload completes, so a writer that is
    discarded, or a process killed mid-upload, leaves nothing under the object's name.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self._file = store_call(url, lambda fs, key: fs.open(key, "wb"))
        self.closed = False

    def write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except Exception as exc:
            raise store_error(self.url, exc) from None

    def close(self) -> None:
        """Finish the upload: the object appears now."""
        if self.closed:
            return
        self.closed = True
        try:
            self._file.close()
        except Exception as exc:
            raise store_error(self.url, exc) from None

    def discard(self) -> None:
        """Abandon the upload; nothing is published (safe to call more than once)."""
        if self.closed:
            return
        self.closed = True
        drop = getattr(self._file, "discard", None)
        with contextlib.suppress(Exception):  # the upload is being abandoned either way
            if drop is not None:
                drop()
        self._file.closed = True  # never let a later close() publish the partial object
