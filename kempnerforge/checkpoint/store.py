"""Checkpoints in an object store (checkpoint.dir a URL): uploads of a staged save, the
marker and ``latest`` objects, fetching a rank's share for a resume, retention.

A store has no rename, so a save is written to the local staging directory exactly as a
local save is (DCP files hashed while written, train state, checksums), then each rank
uploads its own files under ``<url>/step_<N>/``, several at a time (large ones in parts).
Only once every rank's uploads are confirmed does rank 0 write ``step_<N>/complete.json``
and then ``latest``: a prefix without its marker is an interrupted save, which no reader
takes and a later save deletes. Retention deletes a checkpoint's marker first, so a
half-deleted one is never taken as complete.

Every batch of transfers is bounded by checkpoint.store_timeout_s: a stalled store fails
the save (the failed-save path) instead of hanging the run.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from kempnerforge.checkpoint.disk_format import LATEST, MARKER, STEP_DIR
from kempnerforge.checkpoint.publish import retained
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger
from kempnerforge.storage.location import join
from kempnerforge.storage.stores import StoreError, store_call

logger = get_logger(__name__)

SPAN_GAP = 1 << 20
"""Ranges of one file closer than this are read in one request: a store's latency (tens of
ms) costs more than the bytes between them."""


class CheckpointStore:
    """The checkpoints under store URL ``url``; transfers go ``connections`` at a time and
    each batch of them fails after ``timeout_s`` seconds."""

    def __init__(self, url: str, *, timeout_s: float, connections: int) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connections = connections

    def object_url(self, name: str, file: str = "") -> str:
        """The URL of checkpoint `name` (``step_<N>``), or of one of its files."""
        url = join(self.url, name)
        return join(url, file) if file else url

    def upload(self, local: Path, name: str, files: Iterable[str]) -> None:
        """Upload `files` of the local directory `local` into checkpoint `name`, in
        parallel; returns once the store has confirmed every one (StoreError otherwise).
        Each local file is deleted once the store has it, so a node's staging directory
        (rank 0 clears its own at the commit) holds no save after its upload."""

        def put(file: str) -> None:
            url = self.object_url(name, file)
            store_call(url, lambda fs, key: fs.put_file(str(local / file), key))
            (local / file).unlink(missing_ok=True)

        self._parallel(put, sorted(set(files)), f"uploading {name}")

    def download(
        self, name: str, local: Path, files: Iterable[str], *, missing_ok: bool = False
    ) -> None:
        """Fetch `files` of checkpoint `name` into `local` in parallel, each written to a
        temporary file and renamed (a rank sharing the directory never reads half a
        file). With `missing_ok`, an object the store lacks is left out, and so is any
        local file of its name (a check then says it is missing)."""
        local.mkdir(parents=True, exist_ok=True)

        def get(file: str) -> None:
            url = self.object_url(name, file)
            fd, tmp = tempfile.mkstemp(prefix=f".{file}.", dir=local)
            os.close(fd)
            try:
                try:
                    store_call(url, lambda fs, key: fs.get_file(key, tmp))
                except StoreError:
                    if not missing_ok or self.exists(url):
                        raise
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(local / file)
                    return
                os.replace(tmp, local / file)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

        self._parallel(get, sorted(set(files)), f"reading {name}")

    def read_spans(self, name: str, local: Path, spans: Iterable[tuple[str, int, int]]) -> None:
        """Fetch byte ranges (file, offset, length) of checkpoint `name` with ranged reads
        (neighbours less than SPAN_GAP apart in one), in parallel, writing each at its
        offset in `local`/file (created when absent: a sparse file holding only what a
        load reads)."""
        local.mkdir(parents=True, exist_ok=True)

        def get(span: tuple[str, int, int]) -> None:
            file, offset, length = span
            url = self.object_url(name, file)
            data = store_call(
                url, lambda fs, key: fs.cat_file(key, start=offset, end=offset + length)
            )
            if len(data) != length:
                raise StoreError(f"{url}: {len(data)} bytes at {offset}, expected {length}")
            fd = os.open(local / file, os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        self._parallel(get, coalesce(spans), f"reading {name}")

    def exists(self, url: str) -> bool:
        """Whether the object `url` exists: one metadata request."""
        return store_call(url, lambda fs, key: bool(fs.exists(key)))

    def has_marker(self, name: str) -> bool:
        return self.exists(self.object_url(name, MARKER))

    def publish(self, local: Path, name: str) -> None:
        """Upload the marker of `name` (already written in `local`), then point ``latest``
        at it: the order that makes a checkpoint complete before anything names it."""
        self.upload(local, name, [MARKER])
        url = join(self.url, LATEST)
        store_call(url, lambda fs, key: fs.pipe_file(key, (name + "\n").encode()))

    def read_latest(self) -> str | None:
        """The checkpoint name ``latest`` holds, or None when there is none (or it names
        no ``step_<N>``)."""
        url = join(self.url, LATEST)

        def read(fs: Any, key: str) -> bytes | None:
            try:
                return fs.cat_file(key)
            except FileNotFoundError:
                return None

        data = store_call(url, read)
        if data is None:
            return None
        name = data.decode("utf-8", errors="replace").strip()
        return name if STEP_DIR.fullmatch(name) else None

    def latest(self) -> str | None:
        """read_latest(), None when the store cannot be read (for a report only)."""
        try:
            return self.read_latest()
        except StoreError:
            return None

    def step_names(self) -> list[tuple[int, str]]:
        """(step, name) of every ``step_<N>`` prefix, marked or not, newest first: one
        listing of the checkpoint prefix (its top level only)."""

        def names(fs: Any, key: str) -> list[str]:
            try:
                return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(key, detail=False)]
            except FileNotFoundError:
                return []

        found = []
        for entry in store_call(self.url, names):
            match = STEP_DIR.fullmatch(entry)
            if match:
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def marked(self) -> list[tuple[int, str]]:
        """The ``step_<N>`` prefixes holding a marker, newest first (one request each)."""
        return [(step, name) for step, name in self.step_names() if self.has_marker(name)]

    def delete(self, name: str) -> None:
        """Delete checkpoint `name`: its marker first (from then on no reader takes it),
        then every other object under its prefix."""
        marker = self.object_url(name, MARKER)
        store_call(marker, lambda fs, key: fs.rm_file(key) if fs.exists(key) else None)
        prefix = self.object_url(name)

        def remove_all(fs: Any, key: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(key, recursive=True)

        store_call(prefix, remove_all)

    def remove_unmarked(self, keep: str | None = None) -> None:
        """Delete the prefixes interrupted saves left (no marker), except `keep`."""
        for _, name in self.step_names():
            if name != keep and not self.has_marker(name):
                logger.info("removing %s, left by an interrupted save", self.object_url(name))
                self.delete(name)

    def _parallel(self, action: Callable[[Any], None], files: list[Any], what: str) -> None:
        """Run `action` on every file, `connections` at once, within `timeout_s`; the
        first failure (or the deadline) raises StoreError naming the checkpoint."""
        if not files:
            return
        pool = ThreadPoolExecutor(
            min(self.connections, len(files)), thread_name_prefix="kempnerforge-store"
        )
        try:
            futures = [pool.submit(action, file) for file in files]
            done, late = wait(futures, timeout=self.timeout_s)
            for future in futures:
                if future in done and future.exception() is not None:
                    raise _as_store_error(future.exception(), self.url)
            if late:
                raise StoreError(
                    f"{self.url}: {what} took longer than checkpoint.store_timeout_s = "
                    f"{self.timeout_s:g} s ({len(late)} of {len(files)} files unfinished); "
                    "check the store's health, or raise the timeout for a slow store"
                )
        finally:
            pool.shutdown(wait=False, cancel_futures=True)


def _as_store_error(error: BaseException | None, url: str) -> StoreError:
    if isinstance(error, StoreError):
        return error
    return StoreError(f"{url}: {type(error).__name__}: {error}")


def clear_local(path: Path) -> None:
    """Delete a staged copy that is no longer needed (its upload is confirmed)."""
    shutil.rmtree(path, ignore_errors=True)


def prepare_store_save(store: CheckpointStore, name: str, *, first: bool) -> None:
    """Before a save of checkpoint `name`: at the run's first save, delete what
    interrupted saves left (prefixes without a marker); and delete an earlier `name`,
    which its upload would overwrite in place, unless ``latest`` names it (CheckpointError:
    a store cannot swap a complete checkpoint for a new one without a moment with none)."""
    if first:
        store.remove_unmarked()
    if store.read_latest() == name:
        raise CheckpointError(
            store.object_url(name),
            f"'{LATEST}' names this checkpoint, which saving it again would overwrite in "
            "place; resume from it (checkpoint.resume_from = 'auto') or use another "
            "checkpoint.dir",
        )
    if any(found == name for _, found in store.step_names()):
        store.delete(name)


def store_retention(store: CheckpointStore, ours: set[str], cfg: CheckpointConfig) -> list[str]:
    """Delete the checkpoints of `ours` (names this run wrote or verified, the newest
    among them) that checkpoint.keep_last_n and keep_every do not keep; return their names.
    A checkpoint this run never saw complete is never deleted here."""
    if cfg.keep_last_n == 0:
        return []
    steps = {int(name.removeprefix("step_")): name for name in ours}
    keep = retained(list(steps), keep_last_n=cfg.keep_last_n, keep_every=cfg.keep_every)
    gone = []
    for step, name in sorted(steps.items()):
        if step not in keep:
            store.delete(name)  # marker first
            logger.info(
                "removed old checkpoint %s (checkpoint.keep_last_n = %d, keep_every = %d)",
                store.object_url(name),
                cfg.keep_last_n,
                cfg.keep_every,
            )
            gone.append(name)
    return gone


def default_staging(url: str) -> str:
    """Where a manager given no staging directory stages the checkpoints of `url`: a
    directory of the system's temporary space named after the URL."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"kempnerforge-staging-{digest}")


def coalesce(spans: Iterable[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """`spans` (file, offset, length) with those of one file less than SPAN_GAP apart
    merged into one."""
    merged: list[tuple[str, int, int]] = []
    for file, offset, length in sorted(set(spans)):
        if merged and merged[-1][0] == file and offset - sum(merged[-1][1:]) < SPAN_GAP:
            start = merged[-1][1]
            merged[-1] = (file, start, max(sum(merged[-1][1:]), offset + length) - start)
        else:
            merged.append((file, offset, length))
    return merged
