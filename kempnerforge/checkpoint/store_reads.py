"""Reading checkpoints back from an object store: which ones to try, and a rank's share.

Rank 0 lists the checkpoint prefix once and asks for the marker of each ``step_<N>``
(a prefix without one is an interrupted save, never a candidate). Each rank then fetches
into its staged copy only what its own check and load read: the marker and DCP's
.metadata (shared, small), its train state, and the DCP files and checksums of its share
(integrity.share_files), all at once over checkpoint.store_connections. An item a load
reads from another rank's file (a replicated tensor DCP saved once, or any item when the
layout changed) is fetched when DCP asks for it (reader.FETCHERS), with a ranged read of
its bytes only, written at its offset in the staged file. The staged copy is then checked
and loaded exactly as a local checkpoint is.

Each of these (the listing, a rank's fetch, each read a load asks for) ends within
checkpoint.store_timeout_s. A store that fails or stalls raises CheckpointStoreError: an
outage says nothing about the checkpoints, so none is skipped as broken.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

from kempnerforge.checkpoint.choice import Candidate, Candidates
from kempnerforge.checkpoint.disk_format import DCP_METADATA, LATEST, MARKER, STEP_DIR
from kempnerforge.checkpoint.integrity import share_files
from kempnerforge.checkpoint.reader import FETCHERS, Span
from kempnerforge.checkpoint.store import CheckpointStore, new_store, store_failed
from kempnerforge.checkpoint.store_saves import default_staging
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger
from kempnerforge.storage.stores import StoreError

logger = get_logger(__name__)


def split_store_url(url: str) -> tuple[str, str | None]:
    """(the checkpoints prefix, the checkpoint named or None for the newest there) of a
    URL naming a checkpoint in a store: ``<prefix>/step_<N>``, ``<prefix>/latest`` or the
    checkpoints prefix itself."""
    url = url.rstrip("/")
    parent, _, last = url.rpartition("/")
    if parent.endswith(":/"):  # a bucket alone: s3://bucket
        return url, None
    if STEP_DIR.fullmatch(last):
        return parent, last
    return (parent, None) if last == LATEST else (url, None)


class StagedStores:
    """The stores whose checkpoints a manager reads, each by the local folder its
    checkpoints are staged in (a staged checkpoint's parent): the run's own store in its
    staging directory, another one (a resume_from URL) in a folder of its own there, or
    of the system's temporary space without one (`staging`)."""

    def __init__(self, cfg: CheckpointConfig, staging: Path | None) -> None:
        self.cfg = cfg
        self.staging = staging
        self._by_folder: dict[Path, CheckpointStore] = {}

    def add(self, store: CheckpointStore, folder: Path) -> None:
        self._by_folder[folder] = store

    def of(self, root: Path) -> CheckpointStore | None:
        """The store the staged checkpoint `root` comes from; None for a local one."""
        return self._by_folder.get(root.parent)

    def staged(self, url: str) -> tuple[Path, CheckpointStore]:
        """The staging folder and store of the checkpoints under `url` (added when new)."""
        for folder, store in self._by_folder.items():
            if store.url == url.rstrip("/"):
                return folder, store
        base = self.staging or Path(default_staging(url))
        folder = base / f"from-{hashlib.sha256(url.encode()).hexdigest()[:16]}"
        self.add(new_store(url, self.cfg), folder if self.staging else base)
        return self.staged(url)

    def location_of(self, path: str | os.PathLike[str]) -> str:
        """Where `path` lives: its URL when it is (in) a staged copy of a store's
        checkpoint, else `path` itself."""
        text = str(path)
        for folder, store in self._by_folder.items():
            if text == str(folder):
                return store.url
            if text.startswith(f"{folder}{os.sep}"):
                return f"{store.url}/{text[len(str(folder)) + 1 :]}"
        return text

    @contextlib.contextmanager
    def by_url(self) -> Iterator[None]:
        """Name checkpoints by their URLs, not their staged copies, in a CheckpointError
        raised in the block."""
        try:
            yield
        except CheckpointError as error:
            if self._by_folder:
                error.path = self.location_of(error.path)
                for folder, store in self._by_folder.items():
                    error.problem = error.problem.replace(str(folder), store.url)
                error.args = (f"{error.path}: {error.problem}",)
            raise


def store_candidates(
    store: CheckpointStore, staging: Path, name: str | None, *, required: bool
) -> Candidates:
    """The checkpoints of `store` to try, as staged copies under `staging`: `name`, or
    (None) the marked checkpoint ``latest`` names, then the other marked ones, newest
    first. One listing and one marker request per prefix, by one deadline. With
    `required`, a store holding no marked checkpoint is a CheckpointError naming it;
    a store that fails is CheckpointStoreError."""
    if name is not None:
        return Candidates(staging, explicit=staging / name)
    deadline = store.deadline()
    try:
        latest = store.read_latest(deadline)
        marked = [found for _, found in store.marked(deadline)]
    except StoreError as error:
        raise store_failed(store.url, error, "listing its checkpoints") from None
    if required and not marked:
        raise CheckpointError(store.url, f"holds no complete checkpoint (no {MARKER} found)")
    if latest is not None and latest not in marked:
        logger.warning(
            "'%s' names %s, which has no %s (a save or deletion was interrupted): not "
            "taken; trying the marked checkpoints under %s, newest first",
            LATEST,
            store.object_url(latest),
            MARKER,
            store.url,
        )
    tries = []
    if latest in marked:
        label = f"{store.object_url(latest)} named by '{LATEST}'"
        tries.append(Candidate(staging / latest, label, True))
    tries += [Candidate(staging / n, store.object_url(n)) for n in marked if n != latest]
    why = f"no '{LATEST}' object" if latest is None else f"'{LATEST}' names no marked checkpoint"
    return Candidates(staging, None, tries, bool(marked), why)


def fetch_share(store: CheckpointStore, root: Path, rank: int, world_size: int) -> None:
    """Fetch into `root` (the staged copy of checkpoint ``root.name``) what this rank's
    check and load read, by one deadline; objects the store lacks are left out (the check
    names them). A store that fails raises StoreError."""
    name = root.name
    deadline = store.deadline()
    store.download(name, root, [MARKER, DCP_METADATA], missing_ok=True, deadline=deadline)
    share = share_files(root, rank, world_size)
    store.download(name, root, share, missing_ok=True, deadline=deadline)

    def fetch_for_load(spans: list[Span]) -> None:
        try:
            store.read_spans(name, root, [span for span in spans if span[0] not in share])
        except StoreError as error:
            raise store_failed(store.object_url(name), error, "reading it for the load") from None

    FETCHERS[root] = fetch_for_load
