"""Checkpoints in an object store (checkpoint.dir a URL): the transfers of a checkpoint's
files, its marker and ``latest`` objects, listing, deleting.

A store has no rename, so a save is written to the local staging directory exactly as a
local save is (DCP files hashed while written, train state, checksums), then each rank
uploads its own files under ``<url>/step_<N>/``, several at a time (large ones in parts).
Only once every rank's uploads are confirmed does rank 0 write ``step_<N>/complete.json``
and then ``latest``: a prefix without its marker is an interrupted save, which no reader
takes and a later save deletes. Retention deletes a checkpoint's marker first, so a
half-deleted one is never taken as complete. store_saves.py holds the save's steps,
store_reads.py the resume's.

Every operation here ends by checkpoint.store_timeout_s (one Deadline, given by the caller
or started by the call; storage/deadlines.py): a batch of transfers, a listing, the
marker and ``latest`` together. Transfers run on daemon threads whose calls are cancelled
at the deadline, so a stalled store fails the operation in time and keeps no thread alive.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from kempnerforge.checkpoint.disk_format import LATEST, MARKER, STEP_DIR
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger
from kempnerforge.storage.deadlines import Deadline, DeadlinePassed, run_parallel
from kempnerforge.storage.location import join, scheme_of
from kempnerforge.storage.stores import S3_PROTOCOLS, StoreError, StoreTimeout, store_call

logger = get_logger(__name__)
T = TypeVar("T")

TIMEOUT_FIELD = "checkpoint.store_timeout_s"
SPAN_GAP = 1 << 20
"""Ranges of one file closer than this are read in one request: a store's latency (tens of
ms) costs more than the bytes between them."""
DOWNLOAD_PART = 32 << 20
"""A file larger than this is fetched in ranged parts of this size, several at once: one
stream per file reaches a fraction of what a store serves."""


class CheckpointStoreError(CheckpointError):
    """The store holding checkpoints failed or did not answer in time while they were being
    found or read: nothing is known about them, so none is taken as broken (an outage must
    not send a resume back to an older checkpoint). Names the store's URL and its error."""


def store_failed(url: str, error: StoreError, doing: str) -> CheckpointStoreError:
    """The CheckpointStoreError of `error`, raised while `doing` (reading the checkpoints
    of `url`, ...): what to do is to try again once the store answers."""
    return CheckpointStoreError(
        url,
        f"the store failed while {doing} ({error}); no checkpoint was judged or changed: "
        "run again once the store answers",
    )


def new_store(url: str, cfg: CheckpointConfig) -> CheckpointStore:
    """The CheckpointStore of `url` with the deadlines and connections of `cfg`."""
    return CheckpointStore(url, timeout_s=cfg.store_timeout_s, connections=cfg.store_connections)


class CheckpointStore:
    """The checkpoints under store URL ``url``; transfers go ``connections`` at a time, and
    each operation ends within ``timeout_s`` seconds (checkpoint.store_timeout_s)."""

    def __init__(self, url: str, *, timeout_s: float, connections: int) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.connections = connections
        self.swept = False
        """Whether a save has removed what interrupted saves left (prepare_store_save)."""
        self.known_latest: str | None = None
        """What ``latest`` named when this process last read or wrote it (for reports,
        which must not wait for a store that has just failed)."""

    def deadline(self) -> Deadline:
        """A new deadline of checkpoint.store_timeout_s for one operation."""
        return Deadline(self.timeout_s, TIMEOUT_FIELD)

    def call(self, url: str, action: Callable[[Any, str], T], deadline: Deadline | None) -> T:
        """store_call by `deadline` (a new one when None)."""
        return store_call(url, action, deadline=deadline or self.deadline())

    def object_url(self, name: str, file: str = "") -> str:
        """The URL of checkpoint `name` (``step_<N>``), or of one of its files."""
        url = join(self.url, name)
        return join(url, file) if file else url

    def upload(
        self, local: Path, name: str, files: Iterable[str], deadline: Deadline | None = None
    ) -> None:
        """Upload `files` of the local directory `local` into checkpoint `name`, in
        parallel; returns once the store has confirmed every one (StoreError otherwise).
        Each local file is deleted once the store has it, so a node's staging directory
        (rank 0 clears its own at the commit) holds no save after its upload."""
        deadline = deadline or self.deadline()

        def put(file: str) -> None:
            url = self.object_url(name, file)
            self.call(url, lambda fs, key: fs.put_file(str(local / file), key, **parts), deadline)
            (local / file).unlink(missing_ok=True)

        # A rank's share is mostly one large file: its parts go up side by side too.
        parts = {"max_concurrency": self.connections} if self._is_s3() else {}
        self._parallel(put, sorted(set(files)), f"uploading {name}", deadline)

    def download(
        self,
        name: str,
        local: Path,
        files: Iterable[str],
        *,
        missing_ok: bool = False,
        deadline: Deadline | None = None,
    ) -> None:
        """Fetch `files` of checkpoint `name` into `local` in parallel, each written to a
        temporary file and renamed (a rank sharing the directory never reads half a
        file). With `missing_ok`, an object the store lacks is left out, and so is any
        local file of its name (a check then says it is missing)."""
        deadline = deadline or self.deadline()
        local.mkdir(parents=True, exist_ok=True)
        files = sorted(set(files))
        sizes = self.sizes(name, deadline)
        large = [f for f in files if sizes.get(f, 0) > DOWNLOAD_PART]
        if large:  # in parts, side by side, into files renamed into place once whole
            spans = [
                (f, start, min(DOWNLOAD_PART, sizes[f] - start))
                for f in large
                for start in range(0, sizes[f], DOWNLOAD_PART)
            ]
            for file in large:
                (local / f"{file}.part").unlink(missing_ok=True)
            self.read_spans(name, local, spans, into=".part", merge=False, deadline=deadline)
            for file in large:
                os.replace(local / f"{file}.part", local / file)

        def get(file: str) -> None:
            if missing_ok and file not in sizes:  # the listing is the store's answer
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(local / file)
                return
            url = self.object_url(name, file)
            fd, tmp = tempfile.mkstemp(prefix=f".{file}.", dir=local)
            os.close(fd)
            try:
                self.call(url, lambda fs, key: fs.get_file(key, tmp), deadline)
                os.replace(tmp, local / file)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

        self._parallel(get, [f for f in files if f not in large], f"reading {name}", deadline)

    def sizes(self, name: str, deadline: Deadline | None = None) -> dict[str, int]:
        """The size of each object of checkpoint `name`, by file name: one listing."""

        def listing(fs: Any, key: str) -> dict[str, int]:
            try:
                entries = fs.ls(key, detail=True)
            except FileNotFoundError:
                return {}
            return {
                str(e["name"]).rsplit("/", 1)[-1]: int(e.get("size") or 0)
                for e in entries
                if e.get("type", "file") == "file"
            }

        return self.call(self.object_url(name), listing, deadline)

    def read_spans(
        self,
        name: str,
        local: Path,
        spans: Iterable[tuple[str, int, int]],
        *,
        into: str = "",
        merge: bool = True,
        deadline: Deadline | None = None,
    ) -> None:
        """Fetch byte ranges (file, offset, length) of checkpoint `name` with ranged reads
        (with `merge`, neighbours less than SPAN_GAP apart in one), in parallel, writing
        each at its offset in `local`/file + `into` (created when absent: a sparse file
        holding only what a load reads)."""
        deadline = deadline or self.deadline()
        local.mkdir(parents=True, exist_ok=True)

        def get(span: tuple[str, int, int]) -> None:
            file, offset, length = span
            url = self.object_url(name, file)
            data = self.call(
                url, lambda fs, key: fs.cat_file(key, start=offset, end=offset + length), deadline
            )
            if len(data) != length:
                raise StoreError(f"{url}: {len(data)} bytes at {offset}, expected {length}")
            fd = os.open(local / (file + into), os.O_WRONLY | os.O_CREAT, 0o644)
            try:
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        chosen = coalesce(spans) if merge else sorted(set(spans))
        self._parallel(get, chosen, f"reading {name}", deadline)

    def exists(self, url: str, deadline: Deadline | None = None) -> bool:
        """Whether the object `url` exists: one metadata request."""
        return self.call(url, lambda fs, key: bool(fs.exists(key)), deadline)

    def has_marker(self, name: str, deadline: Deadline | None = None) -> bool:
        return self.exists(self.object_url(name, MARKER), deadline)

    def publish(self, local: Path, name: str) -> None:
        """Upload the marker of `name` (already written in `local`), then point ``latest``
        at it: the order that makes a checkpoint complete before anything names it. Both
        by one deadline; ``latest`` is never written once the marker's upload failed or
        was abandoned."""
        deadline = self.deadline()
        self.upload(local, name, [MARKER], deadline)
        data = (name + "\n").encode()
        self.call(join(self.url, LATEST), lambda fs, key: fs.pipe_file(key, data), deadline)
        self.known_latest = name

    def read_latest(self, deadline: Deadline | None = None) -> str | None:
        """The checkpoint name ``latest`` holds, or None when there is none (or it names
        no ``step_<N>``)."""

        def read(fs: Any, key: str) -> bytes | None:
            try:
                return fs.cat_file(key)
            except FileNotFoundError:
                return None

        data = self.call(join(self.url, LATEST), read, deadline)
        name = None if data is None else data.decode("utf-8", errors="replace").strip()
        self.known_latest = name if name is not None and STEP_DIR.fullmatch(name) else None
        return self.known_latest

    def step_names(self, deadline: Deadline | None = None) -> list[tuple[int, str]]:
        """(step, name) of every ``step_<N>`` prefix, marked or not, newest first: one
        listing of the checkpoint prefix (its top level only)."""

        def names(fs: Any, key: str) -> list[str]:
            try:
                return [str(p).rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(key, detail=False)]
            except FileNotFoundError:
                return []

        found = []
        for entry in self.call(self.url, names, deadline):
            match = STEP_DIR.fullmatch(entry)
            if match:
                found.append((int(match.group(1)), entry))
        return sorted(found, reverse=True)

    def marked(self, deadline: Deadline | None = None) -> list[tuple[int, str]]:
        """The ``step_<N>`` prefixes holding a marker, newest first (one request each)."""
        deadline = deadline or self.deadline()
        return [
            (step, name)
            for step, name in self.step_names(deadline)
            if self.has_marker(name, deadline)
        ]

    def delete(self, name: str, deadline: Deadline | None = None) -> None:
        """Delete checkpoint `name`: its marker first (from then on no reader takes it),
        then every other object under its prefix."""
        deadline = deadline or self.deadline()
        marker = self.object_url(name, MARKER)
        self.call(marker, lambda fs, key: fs.rm_file(key) if fs.exists(key) else None, deadline)

        def remove_all(fs: Any, key: str) -> None:
            with contextlib.suppress(FileNotFoundError):
                fs.rm(key, recursive=True)

        self.call(self.object_url(name), remove_all, deadline)
        self.abort_uploads(name, deadline=deadline)

    def abort_uploads(
        self,
        name: str = "",
        *,
        unless: Callable[[str], bool] | None = None,
        deadline: Deadline | None = None,
    ) -> int:
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

        aborted = self.call(where, abort, deadline)
        if aborted:
            logger.info("aborted %d unfinished uploads under %s", aborted, where)
        return aborted

    def _is_s3(self) -> bool:
        return scheme_of(self.url) in S3_PROTOCOLS

    def remove_unmarked(self, keep: str | None = None, deadline: Deadline | None = None) -> None:
        """Delete the prefixes interrupted saves left (no marker), except `keep`."""
        deadline = deadline or self.deadline()
        marked = {keep}
        for _, name in self.step_names(deadline):
            if name == keep or self.has_marker(name, deadline):
                marked.add(name)
            else:
                logger.info("removing %s, left by an interrupted save", self.object_url(name))
                self.delete(name, deadline)
        # Also prefixes holding only parts.
        self.abort_uploads(unless=marked.__contains__, deadline=deadline)

    def _parallel(
        self, action: Callable[[Any], None], files: list[Any], what: str, deadline: Deadline
    ) -> None:
        """Run `action` on every file, `connections` at once, by `deadline`; the first
        failure is raised (a StoreError naming the object, or a local OSError), the
        deadline as StoreTimeout naming the checkpoint."""
        try:
            run_parallel(action, files, workers=self.connections, deadline=deadline)
        except DeadlinePassed as late:
            raise StoreTimeout(
                f"{self.url}: {what} took longer than {deadline.describe()} ({late.unfinished} "
                f"of its {late.total} files unfinished); check the store's health, or raise "
                "the timeout for a slow store"
            ) from None


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
