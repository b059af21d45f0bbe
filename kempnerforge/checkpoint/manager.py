"""CheckpointManager: atomic DCP checkpoints (sync or async), `latest`, retention, resume.

On disk, under the checkpoint directory::

    latest                    text file naming the newest committed checkpoint ("step_30")
    step_30/                  one committed checkpoint
        .metadata, *.distcp   DCP files of {"model": ..., "optimizer": ...}, FQN keyed
        train_state_rank<R>.pt  torch.save of rank R's plain-typed train state
        checksums_rank<R>.json  CRC-32 and length of each file rank R wrote
        complete.json         completion marker, written last
    step_40.tmp/              a save in progress (or left by a crash; removed by the next save)

Saving (atomic commits, async mode, fault injection) is saver.py; which checkpoint to
resume is choice.py; whether one is complete is integrity.py (each rank checks the files it
reads, the verdict agreed in one small collective); reading one back is resume.py. A save
in flight is committed before anything is found or loaded, so a load never misses the
newest checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kempnerforge.checkpoint.choice import Candidates, choose, list_candidates
from kempnerforge.checkpoint.coordination import Coordinator
from kempnerforge.checkpoint.disk_format import STEP_DIR
from kempnerforge.checkpoint.integrity import checkpoint_problems, share_problems
from kempnerforge.checkpoint.publish import names_blocking_saves
from kempnerforge.checkpoint.resume import (
    load_model_and_optimizer,
    load_model_weights,
    read_train_state,
    require_marker,
    saved_keys,
)
from kempnerforge.checkpoint.saver import CheckpointSaver
from kempnerforge.checkpoint.store import CheckpointStoreError, new_store, store_failed
from kempnerforge.checkpoint.store_reads import (
    StagedStores,
    fetch_share,
    split_store_url,
    store_candidates,
)
from kempnerforge.checkpoint.store_saves import default_staging
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.errors import CheckpointError, incomplete
from kempnerforge.core.logging import get_logger
from kempnerforge.storage.location import is_store_url, local_path
from kempnerforge.storage.stores import StoreError

__all__ = ["CheckpointError", "CheckpointManager"]

logger = get_logger(__name__)


class CheckpointManager(CheckpointSaver):
    """Saves, finds and loads this run's checkpoints (see the module docstring for layout).

    Every rank constructs one and calls save/poll/wait/load/find_resume_path together:
    those are collective when world_size > 1 (``rank`` is the rank in ``process_group``,
    the default group when None), and their agreements run on ``process_group``.
    ``side_group`` is a gloo group over the same ranks for the background writes of async
    mode (the runtime's side group); the manager creates no group of its own, except that
    one, once, at the first async save when it was given none. The directory must be one
    shared filesystem path for all ranks, or a store URL (then ``staging_dir``, else
    checkpoint.staging_dir, is where saves and resumes stage their files); checkpoints
    named by a URL of another store are staged there too. ``config_sha256`` is recorded in
    each marker unless a save passes its own.

    Saving (save, poll, writing, record_write_vote, on_commit, failed_saves_in_a_row) is
    the CheckpointSaver this class extends; finding, checking and loading are here.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        process_group: dist.ProcessGroup | None = None,
        side_group: dist.ProcessGroup | None = None,
        config_sha256: str = "",
        staging_dir: str = "",
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if world_size > 1 and not initialized:
            raise ValueError(f"world_size={world_size} needs torch.distributed to be initialized")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        store = None
        staging = staging_dir or cfg.staging_dir
        if is_store_url(directory):
            store = new_store(directory, cfg)
            directory = staging or default_staging(directory)
        root = Path(local_path(directory))
        super().__init__(
            cfg,
            root,
            Coordinator(root, rank=rank, world_size=world_size, process_group=process_group),
            rank=rank,
            world_size=world_size,
            process_group=process_group,
            side_group=side_group,
            no_dist=not initialized,
            config_sha256=config_sha256,
        )
        self.store = store
        self._verified: set[Path] = set()
        """Checkpoints a verdict of this run found complete: a load of one checks no more."""
        self.stores = StagedStores(cfg, Path(local_path(staging)) if staging else None)
        """The stores whose checkpoints this manager reads, and where each is staged."""
        if store is not None:
            self.stores.add(store, root)

    def location_of(self, path: str | os.PathLike[str]) -> str:
        """Where checkpoint `path` (or a file of it) lives: its URL when it is the staged
        copy of a checkpoint in a store, else `path` itself. What reports and events name."""
        return self.stores.location_of(path)

    @property
    def pending_step(self) -> int | None:
        """The step of the async save being written and not yet committed, or None."""
        return None if self.pending is None else self.pending.step

    def is_on_schedule(self, step: int) -> bool:
        """True when `step` is a positive multiple of checkpoint.interval (never if it is 0)."""
        return self.cfg.interval > 0 and step > 0 and step % self.cfg.interval == 0

    def should_save(self, step: int, max_steps: int) -> bool:
        """True when the loop should save after `step`: on schedule and within the run.

        The end of the run is not included: the loop saves there itself when the last
        step is off schedule (or interval is 0), so each step is saved at most once.
        """
        return self.is_on_schedule(step) and step <= max_steps

    def wait(self) -> None:
        """Block until the save in flight (if any) is durable, then commit it. Collective.

        Raises CheckpointError when its background write failed. In sync mode, or with
        nothing in flight, returns at once. The loop calls it before teardown.
        """
        self.finish_pending()

    def find_resume_path(self) -> str | None:
        """The checkpoint checkpoint.resume_from selects, or None to start fresh. Collective.

        'none' gives None. A path must be a complete checkpoint (a name relative to the
        checkpoint directory also works). 'auto' takes the one ``latest`` names if it is
        complete, otherwise the newest complete ``step_<N>`` (warning which were skipped),
        and None when the directory holds no checkpoint at all; when it holds only broken
        ones this raises, rather than silently starting over. Each checkpoint tried costs
        one verdict (see verify). A save in flight is committed first.
        """
        self.finish_pending()
        return self._choose(self.cfg.resume_from)

    def newest_complete_path(self) -> str | None:
        """The checkpoint a NaN rollback returns to, or None when there is none. Collective.

        The one ``latest`` names when it is complete, else the newest complete
        ``step_<N>``; checkpoint.resume_from plays no part. Each is judged afresh (a
        checkpoint this run wrote may have been damaged since). A save in flight is
        committed first.
        """
        self.finish_pending()
        try:
            return self._choose("auto")
        except CheckpointStoreError:
            raise  # the store failed: nothing is known of its checkpoints
        except CheckpointError:
            return None  # only broken checkpoints: nothing to return to

    def names_blocking_saves(self, first_step: int, last_step: int) -> list[str]:
        """What in the checkpoint directory would stop a save of a step after `first_step`
        up to `last_step` (a link or file named ``step_<N>``, a directory named
        ``latest``), as rank 0 found it; empty when nothing would. Collective: one listing
        on rank 0 and one broadcast, so a launch can refuse before training, not at step N.
        """
        return self._coord.on_rank0(
            lambda: names_blocking_saves(self.directory, first_step, last_step)
        )

    def verify(self, path: str | os.PathLike[str]) -> list[str]:
        """What keeps `path` from being a complete checkpoint, as every rank agrees; empty
        when it is complete. Collective.

        One pass split over the ranks: each checks the shared files it needs (marker,
        .metadata) and the files it will read itself (its train state, its share of the
        DCP files: lengths, zip records and checksums, reading each whole file once), and
        the verdicts are agreed in one all-reduce of an integer (the failing rank then
        sends its report). So this reads the rank's share of the checkpoint once more
        before a load; the OS page cache usually serves the load that follows. A staged
        copy of a checkpoint in a store is fetched first (each rank its share); a store
        that fails on any rank raises CheckpointStoreError on every rank, since an outage
        says nothing about the checkpoint.
        """
        root = Path(path)
        store = self.stores.of(root)
        report: tuple[str, list[str]] | None = None
        try:
            if store is not None:
                fetch_share(store, root, self.rank, self.world_size)
            problems = share_problems(root, self.rank, self.world_size)
            report = ("broken", problems) if problems else None
        except StoreError as e:
            report = ("store", [str(e)])
        except Exception as e:  # a rank that raised alone would leave the others waiting
            report = ("broken", [f"cannot be checked ({type(e).__name__}: {e})"])
        firsthand = report is not None and report[0] == "store"
        agreed = self._coord.first_report(report, firsthand=firsthand)
        if agreed is not None:
            self._verified.discard(root)
            self.known_complete.discard(root)
            kind, problems = agreed[1]
            if kind == "store":
                where = self.location_of(root)
                raise store_failed(where, StoreError(problems[0]), "reading this checkpoint")
            return problems
        self._verified.add(root)
        self.known_complete.add(root)
        return []

    def candidates(self, choice: str) -> Candidates | None:
        """What `choice` (checkpoint.resume_from's forms, or a store URL: a checkpoint,
        a checkpoints prefix, its ``latest``) leaves to try, found by rank 0 and handed to
        every rank; None for 'none'. Collective. A store that fails raises
        CheckpointStoreError on every rank."""
        if is_store_url(choice):  # every rank stages that store's checkpoints alike
            self.stores.staged(split_store_url(choice)[0])

        def listing() -> Candidates | CheckpointError | None:
            try:
                return self._list(choice)
            except CheckpointError as error:  # raised below on every rank alike
                return error

        found = self._coord.on_rank0(listing)
        if isinstance(found, CheckpointError):
            raise found
        return found

    def _list(self, choice: str) -> Candidates | None:
        if choice == "none":
            return None
        if is_store_url(choice):
            prefix, name = split_store_url(choice)
            staging, store = self.stores.staged(prefix)
            return store_candidates(store, staging, name, required=True)
        name = choice.strip("/")
        if self.store is not None and (choice == "auto" or STEP_DIR.fullmatch(name)):
            named = None if choice == "auto" else name
            return store_candidates(self.store, self.directory, named, required=False)
        return list_candidates(self.directory, choice)

    def _choose(self, choice: str) -> str | None:
        with self.stores.by_url():
            candidates = self.candidates(choice)
            if candidates is None:
                return None
            return choose(candidates, self.verify, quiet=self.rank != 0)

    def _require_complete(self, root: Path) -> None:
        """Raise CheckpointError naming `root` and its problem unless it is complete (a
        checkpoint a verdict of this run already found complete is not checked again)."""
        if root in self._verified:
            return
        with self.stores.by_url():
            problems = self.verify(root)
            if problems:
                raise incomplete(root, problems)

    def read_extra(self, path: str) -> dict[str, Any]:
        """The ``extra`` dict saved in checkpoint `path`, loading nothing else. Collective.

        For checks before a resume (the math fingerprint); raises CheckpointError naming
        `path` when it is not a complete checkpoint.
        """
        root = Path(path)
        self._require_complete(root)
        with self.stores.by_url():
            state = self._coord.on_every_rank(
                lambda: read_train_state(root, self.rank, self.world_size, quiet=True)
            )
        extra = state.get("extra")
        return extra if isinstance(extra, dict) else {}

    def read_train_state(self, path: str) -> dict[str, Any]:
        """This rank's train state in checkpoint `path`, loading nothing else. Collective.

        What load() returns, read the same way (weights-only; a rank the saving run did
        not have gets rank 0's, with a warning), for a resume that loads the model by
        itself, e.g. with a fresh optimizer. Raises CheckpointError naming `path` when it
        is not a complete checkpoint.
        """
        root = Path(path)
        self._require_complete(root)
        with self.stores.by_url():
            return self._coord.on_every_rank(
                lambda: read_train_state(root, self.rank, self.world_size)
            )

    def is_complete(self, path: str | os.PathLike[str]) -> bool:
        """True when `path` holds a committed, intact checkpoint, every rank's share
        checked in this one process (for tools and tests; a job uses verify).

        The marker parses, every saved rank's train state is a whole file, DCP's
        ``.metadata`` loads through an allow-list, no file it references is short or
        broken, and every file matches its recorded checksum.
        """
        return not checkpoint_problems(Path(path))

    def load(
        self,
        path: str,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
    ) -> dict[str, Any]:
        """Load `path` into model, optimizer and scheduler; return this rank's train state.

        Model and optimizer reshard to the current world size through DCP. The train state
        (step, tokens_seen, dataloader, rng, extra and the caller's own fields) is read with
        a weights-only load and not applied: restore the RNG last, after anything that
        draws random numbers. A rank the saving run did not have (the world grew) gets
        rank 0's train state, with a warning. A save in flight is committed first, and the
        checkpoint is checked (verify) unless a verdict of this run already found it
        complete. Collective.
        """
        self.finish_pending()
        with self.stores.by_url():
            return self._load(Path(path), model, optimizer, scheduler)

    def _load(
        self,
        root: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
    ) -> dict[str, Any]:
        self._require_complete(root)
        state, saved = self._coord.on_every_rank(
            lambda: (read_train_state(root, self.rank, self.world_size), saved_keys(root))
        )
        load_model_and_optimizer(
            root, model, optimizer, saved, process_group=self.process_group, no_dist=self._no_dist
        )
        try:
            scheduler.load_state_dict(state["scheduler"])
        except Exception as e:
            raise CheckpointError(root, f"the scheduler state does not fit: {e}") from e
        if not state.get("optimizer_initialized", True):
            optimizer.state.clear()  # saved before the first step: see save
        if self.rank == 0:
            logger.info("loaded checkpoint %s (step %d)", self.location_of(root), state["step"])
        return state

    def load_weights(self, path: str, *, model: torch.nn.Module) -> None:
        """Load only the model weights of checkpoint `path` into `model`. Collective.

        For checkpoint.load_weights_only: a model-only DCP load (resharded to this world
        size) that ignores the checkpoint's optimizer entries, scheduler, train state and
        RNG, so the caller starts a new run (fresh optimizer, step 0) from these weights.
        Raises CheckpointError naming `path` when it is incomplete (checked as load()
        checks it) or does not fit `model`. A save in flight is committed first.
        """
        self.finish_pending()
        root = Path(path)
        self._require_complete(root)
        with self.stores.by_url():
            self._load_weights(root, model)

    def _load_weights(self, root: Path, model: torch.nn.Module) -> None:
        def keys() -> set[str]:
            require_marker(root)  # gone since the check: refused, as load() refuses it
            return saved_keys(root)

        load_model_weights(
            root,
            model,
            self._coord.on_every_rank(keys),
            process_group=self.process_group,
            no_dist=self._no_dist,
        )
        if self.rank == 0:
            logger.info("loaded the model weights of checkpoint %s", self.location_of(root))
