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

from kempnerforge.checkpoint.checksums import Checksum, checksums_name
from kempnerforge.checkpoint.disk_format import LATEST, MARKER, STEP_DIR, train_state_name
from kempnerforge.checkpoint.publish import retained
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger
from kempnerforge.storage.location import join, scheme_of
from kempnerforge.storage.stores import S3_PROTOCOLS, StoreError, store_call

logger = get_logger(__name__)

SPAN_GAP = 1 << 20
"""Ranges of one file closer than this are read in one request: a store's latency (tens of
ms) costs more than the bytes between them."""


DOWNLOAD_PART = 32 << 20
"""A file larger than this is fetched in ranged parts of this size, several at once: one
stream per file reaches a fraction of what a store serves."""


class CheckpointStore:
    """The checkpoints under store URL ``url``; transfers go ``connections`` at a time and
    each batch of them fails after ``timeout_s`` seconds."""

    def __init__(self, url: str, *, timeout_s: float, connections: int) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connections = connections
        self.swept = False
        """Whether a save has removed what interrupted saves left (prepare_store_save)."""

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
            store_call(url, lambda fs, key: fs.put_file(str(local / file), key, **parts))
            (local / file).unlink(missing_ok=True)

        # A rank's share is mostly one large file: its parts go up side by side too.
        parts = {"max_concurrency": self.connections} if self._is_s3() else {}

        self._parallel(put, sorted(set(files)), f"uploading {name}")

    def download(
        self, name: str, local: Path, files: Iterable[str], *, missing_ok: bool = False
    ) -> None:
        """Fetch `files` of checkpoint `name` into `local` in parallel, each written to a
        temporary file and renamed (a rank sharing the directory never reads half a
        file). With `missing_ok`, an object the store lacks is left out, and so is any
        local file of its name (a check then says it is missing)."""
        local.mkdir(parents=True, exist_ok=True)
        files = sorted(set(files))
        sizes = self.sizes(name)
        large = [f for f in files if sizes.get(f, 0) > DOWNLOAD_PART]
        if large:  # in parts, side by side, into files renamed into place once whole
            spans = [
                (f, start, min(DOWNLOAD_PART, sizes[f] - start))
                for f in large
                for start in range(0, sizes[f], DOWNLOAD_PART)
            ]
            for file in large:
                (local / f"{file}.part").unlink(missing_ok=True)
            self.read_spans(name, local, spans, into=".part", merge=False)
            for file in large:
                os.replace(local / f"{file}.part", local / file)

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

        self._parallel(get, [f for f in files if f not in large], f"reading {name}")

    def sizes(self, name: str) -> dict[str, int]:
        """The size of each object of checkpoint `name`, by file name: one listing."""

        def listing(fs: Any, key: str) -> dict[str, int]:
            try:
                entries = fs.ls(key, detail=True)
            except FileNotFoundError:
                return {}
            return {str(e["name"]).rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries}

        return store_call(self.object_url(name), listing)

    def read_spans(
        self,
        name: str,
        local: Path,
        spans: Iterable[tuple[str, int, int]],
        *,
        into: str = "",
        merge: bool = True,
    ) -> None:
        """Fetch byte ranges (file, offset, length) of checkpoint `name` with ranged reads
        (with `merge`, neighbours less than SPAN_GAP apart in one), in parallel, writing
        each at its offset in `local`/file + `into` (created when absent: a sparse file
        holding only what a load reads)."""
        local.mkdir(parents=True, exist_ok=True)

        def get(span: tuple[str, int, int]) -> None:
            file, offset, length = span
            url = self.object_url(name, file)
            data = store_call(
                url, lambda fs, key: fs.cat_file(key, start=offset, end=offset + length)
            )
            if len(data) != length:
                raise StoreError(f"{url}: {len(data)} bytes at {offset}, expected {length}")
            fd = os.open(local / (file + into), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        chosen = coalesce(spans) if merge else sorted(set(spans))
        self._parallel(get, chosen, f"reading {name}")

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
        self.abort_uploads(name)

    def abort_uploads(self, name: str = "", *, unless: Callable[[str], bool] | None = None) -> int:
        """Abort the multipart uploads left unfinished under checkpoint `name` (every
        checkpoint when empty, except those whose name `unless` accepts); return how many.
        A process killed mid-upload leaves its parts stored, and billed, but listed by no
        ``ls``. S3 only: other stores keep no parts apart from their objects."""
        if not self._is_s3():
            return 0
        where = self.object_url(name) if name else self.url

        def abort(fs: Any, key: str) -> int:
            bucket, _, prefix = key.partition("/")
            found, page = [], {"IsTruncated": True}
            while page.get("IsTruncated"):
                markers = {
                    k: page[f"Next{k}"]
                    for k in ("KeyMarker", "UploadIdMarker")
                    if page.get(f"Next{k}")
                }
                page = fs.call_s3(
                    "list_multipart_uploads", Bucket=bucket, Prefix=prefix + "/", **markers
                )
                found += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
            if unless is not None:
                found = [(k, u) for k, u in found if not unless(k[len(prefix) + 1 :].split("/")[0])]
            for object_key, upload_id in found:
                fs.call_s3(
                    "abort_multipart_upload", Bucket=bucket, Key=object_key, UploadId=upload_id
                )
            return len(found)

        aborted = store_call(where, abort)
        if aborted:
            logger.info("aborted %d unfinished uploads under %s", aborted, where)
        return aborted

    def _is_s3(self) -> bool:
        return scheme_of(self.url) in S3_PROTOCOLS

    def remove_unmarked(self, keep: str | None = None) -> None:
        """Delete the prefixes interrupted saves left (no marker), except `keep`."""
        marked = {keep}
        for _, name in self.step_names():
            if name == keep or self.has_marker(name):
                marked.add(name)
            else:
                logger.info("removing %s, left by an interrupted save", self.object_url(name))
                self.delete(name)
        self.abort_uploads(unless=marked.__contains__)  # also prefixes holding only parts

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


def prepare_store_save(store: CheckpointStore, name: str) -> None:
    """Before a save of checkpoint `name`: at the first save through `store`, delete what
    interrupted saves left (prefixes without a marker); and delete an earlier `name`,
    which its upload would overwrite in place, unless ``latest`` names it (CheckpointError:
    a store cannot swap a complete checkpoint for a new one without a moment with none)."""
    if not store.swept:
        store.remove_unmarked()
        store.swept = True
    if store.read_latest() == name:
        raise CheckpointError(
            store.object_url(name),
            f"'{LATEST}' names this checkpoint, which saving it again would overwrite in "
            "place; resume from it (checkpoint.resume_from = 'auto') or use another "
            "checkpoint.dir",
        )
    if any(found == name for _, found in store.step_names()):
        store.delete(name)


def upload_rank_files(
    store: CheckpointStore, staged: Path, rank: int, dcp_sums: dict[str, Checksum]
) -> None:
    """Upload what rank `rank` wrote of the staged save `staged` (``step_<N>.tmp``): its
    DCP files (rank 0's include .metadata), train state and checksums."""
    own = [*dcp_sums, train_state_name(rank), checksums_name(rank)]
    store.upload(staged, staged.name.removesuffix(".tmp"), own)


def commit_to_store(
    store: CheckpointStore, staged: Path, complete: set[Path], cfg: CheckpointConfig
) -> None:
    """Rank 0's commit of the staged save `staged` once every rank's uploads are
    confirmed: its marker, then ``latest``; then the staged copy is freed and retention
    runs over `complete` (the staged paths of the checkpoints this run wrote or verified;
    those it deletes leave the set) and this one."""
    name = staged.name.removesuffix(".tmp")
    store.publish(staged, name)
    clear_local(staged)
    ours = {path.name for path in complete} | {name}
    for gone in store_retention(store, ours, cfg):
        complete.discard(staged.parent / gone)


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
