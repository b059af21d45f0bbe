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
"""

from __future__ import annotations

from pathlib import Path

from kempnerforge.checkpoint.choice import Candidate, Candidates, list_candidates
from kempnerforge.checkpoint.disk_format import DCP_METADATA, LATEST, MARKER, STEP_DIR
from kempnerforge.checkpoint.integrity import share_files
from kempnerforge.checkpoint.reader import FETCHERS, Span
from kempnerforge.checkpoint.store import CheckpointStore
from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)


def store_candidates(store: CheckpointStore, staging: Path, choice: str) -> Candidates | None:
    """What `choice` (checkpoint.resume_from) leaves to try, as staged copies under
    `staging`: the marked checkpoint ``latest`` names, then the other marked ones, newest
    first. A name (``step_30``) or a URL under checkpoint.dir names one of the store's; any
    other path is a local checkpoint, as with a local checkpoint.dir."""
    if choice == "none":
        return None
    if choice != "auto":
        name = choice.removeprefix(store.url + "/").strip("/")
        if STEP_DIR.fullmatch(name):
            return Candidates(staging, explicit=staging / name)
        return list_candidates(staging, choice)
    latest = store.read_latest()
    marked = [name for _, name in store.marked()]
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
    check and load read; objects the store lacks are left out (the check names them)."""
    name = root.name
    store.download(name, root, [MARKER, DCP_METADATA], missing_ok=True)
    store.download(name, root, share_files(root, rank, world_size), missing_ok=True)
    share = set(share_files(root, rank, world_size))

    def fetch_for_load(spans: list[Span]) -> None:
        store.read_spans(name, root, [span for span in spans if span[0] not in share])

    FETCHERS[root] = fetch_for_load
