"""The steps of a save into an object store (store.py): before it, each rank's upload, the
commit (marker, then ``latest``) and retention.

Each step that talks to the store ends within checkpoint.store_timeout_s in all, so a save
into a stalled store fails (a failed save: 'latest' unchanged, training goes on) instead of
holding the training thread.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from kempnerforge.checkpoint.checksums import Checksum, checksums_name
from kempnerforge.checkpoint.disk_format import LATEST, train_state_name
from kempnerforge.checkpoint.publish import retained
from kempnerforge.checkpoint.store import CheckpointStore
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger
from kempnerforge.storage.stores import StoreError

logger = get_logger(__name__)

DEADLINES_PER_SAVE = 4
"""The store operations of one save, each ended by checkpoint.store_timeout_s: the checks
before it, a rank's uploads, the commit (marker and ``latest``) and retention. A save into
a store that stalls fails within this many times the timeout (the hang watchdog allows a
checkpoint that long)."""


def clear_local(path: Path) -> None:
    """Delete a staged copy that is no longer needed (its upload is confirmed)."""
    shutil.rmtree(path, ignore_errors=True)


def prepare_store_save(store: CheckpointStore, name: str) -> None:
    """Before a save of checkpoint `name`, by one deadline: at the first save through
    `store`, delete what interrupted saves left (prefixes without a marker); and delete an
    earlier `name`, which its upload would overwrite in place, unless ``latest`` names it
    and it is marked (CheckpointError: a store cannot swap a complete checkpoint for a new
    one without a moment with none). A ``latest`` naming an unmarked prefix names no
    checkpoint (a resume took an older one): saving `name` then is what repairs it."""
    deadline = store.deadline()
    if not store.swept:
        store.remove_unmarked(deadline=deadline)
        store.swept = True
    if store.read_latest(deadline) == name and store.has_marker(name, deadline):
        raise CheckpointError(
            store.object_url(name),
            f"'{LATEST}' names this checkpoint, which saving it again would overwrite in "
            "place; resume from it (checkpoint.resume_from = 'auto') or use another "
            "checkpoint.dir",
        )
    if any(found == name for _, found in store.step_names(deadline)):
        store.delete(name, deadline)


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
    confirmed: its marker, then ``latest`` (a StoreError fails the save); then the staged
    copy is freed and retention runs over `complete` (the staged paths of the
    checkpoints this run wrote or verified; those it deletes leave the set) and this one.
    Retention that fails only warns: the checkpoint is committed, the next commit retries."""
    name = staged.name.removesuffix(".tmp")
    store.publish(staged, name)
    clear_local(staged)
    ours = {path.name for path in complete} | {name}
    try:
        gone = store_retention(store, ours, cfg)
    except StoreError as error:
        logger.warning(
            "%s is committed, but retention could not delete older checkpoints (%s); the "
            "next commit tries again",
            store.object_url(name),
            error,
        )
        return
    for old in gone:
        complete.discard(staged.parent / old)


def store_retention(store: CheckpointStore, ours: set[str], cfg: CheckpointConfig) -> list[str]:
    """Delete the checkpoints of `ours` (names this run wrote or verified, the newest
    among them) that checkpoint.keep_last_n and keep_every do not keep, by one deadline;
    return their names. A checkpoint this run never saw complete is never deleted here."""
    if cfg.keep_last_n == 0:
        return []
    steps = {int(name.removeprefix("step_")): name for name in ours}
    keep = retained(list(steps), keep_last_n=cfg.keep_last_n, keep_every=cfg.keep_every)
    deadline = store.deadline()
    gone = []
    for step, name in sorted(steps.items()):
        if step not in keep:
            store.delete(name, deadline)  # marker first
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
