"""The save path of CheckpointManager: stage, write (sync or async), commit, report failures.

A save fills ``step_<N>.tmp/``, writes the marker, renames the directory to ``step_<N>/``
and only then moves ``latest``, so a crash at any point leaves ``latest`` on a complete
checkpoint. Rank 0 does every rename and deletion; the other ranks wait for it.

With checkpoint.async_mode = 'async', save() copies the model and optimizer state, starts
the DCP write in the background and returns. The commit (marker, rename, ``latest``,
retention) waits until the files are durable and happens in the next save(), in
finish_pending() (the manager's wait(), load(), load_weights() and find_resume_path() call
it first) or in a poll() that finds the write done. At most one save is in flight. A
failed background write is raised by that call as a CheckpointError, with the previous
checkpoint and ``latest`` untouched. poll() commits only when every rank's write is done:
the training step's own reduction carries that vote (record_write_vote), so a step costs
no collective here; without a vote, poll() asks with a one-integer all-reduce.

Each rank writes its DCP files through a ChecksummingWriter (hashing them as they are
written, on the writing thread), then its train state and ``checksums_rank<R>.json``; the
marker says the checkpoint holds checksums (checksums.py, integrity.py).

Fault injection, for tests only and off by default: ``KEMPNERFORGE_FAULT_SAVE_DELAY_S``
(float seconds) sleeps between a save's DCP files and its marker (in the background
when async), and ``KEMPNERFORGE_FAULT_SAVE_DELAY_FROM_STEP`` (int, default 0) delays only
saves of that step or later; see ``background.fault_save_delay``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from kempnerforge.checkpoint.background import BackgroundWriter, PendingSave, fault_save_delay
from kempnerforge.checkpoint.checksums import ChecksummingWriter, write_rank_files
from kempnerforge.checkpoint.coordination import Coordinator, new_gloo_group, quiet_single_process
from kempnerforge.checkpoint.disk_format import (
    CHECKSUM_KIND,
    FORMAT_VERSION,
    LATEST,
    build_train_state,
    fsync_dir,
    read_latest,
    read_marker,
    torch_bytes,
    write_marker,
)
from kempnerforge.checkpoint.failures import FAILURES, Diagnosis, FailedSave, diagnose
from kempnerforge.checkpoint.publish import (
    apply_retention,
    check_names_free,
    discard_partial,
    publish,
    remove_leftovers,
    settle,
)
from kempnerforge.checkpoint.store import CheckpointStore
from kempnerforge.checkpoint.store_saves import (
    clear_local,
    commit_to_store,
    prepare_store_save,
    upload_rank_files,
)
from kempnerforge.checkpoint.tied_head import rename_head_copy
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.errors import CheckpointError
from kempnerforge.core.logging import get_logger
from kempnerforge.storage.stores import StoreError

logger = get_logger(__name__)

CommitCallback = Callable[[int, str, float], None]
"""Called with a committed checkpoint's step, its path and the seconds since its save began."""


class CheckpointSaver:
    """Writes and commits this run's checkpoints; at most one async save in flight.

    The saving half of CheckpointManager, which extends it with finding, checking and
    loading. Collective: every rank calls the same methods in the same order.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: Path,
        coord: Coordinator,
        *,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None,
        side_group: dist.ProcessGroup | None,
        no_dist: bool,
        config_sha256: str,
    ) -> None:
        self.cfg = cfg
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.config_sha256 = config_sha256
        self.known_complete: set[Path] = set()
        """Checkpoints this run wrote or a verdict of it found complete: retention reads
        nothing of them."""
        self._coord = coord
        self._no_dist = no_dist
        self._side_group = side_group
        self._writer = BackgroundWriter()
        self.pending: PendingSave | None = None
        self.on_commit: CommitCallback | None = None
        """Called on every rank once a checkpoint is committed (its directory and ``latest``
        in place), with its step, its path and the seconds since its save started: in sync
        mode before save() returns, in async mode from poll(), wait() or the next save()."""
        self._write_vote: tuple[PendingSave, bool] | None = None
        self.failed_saves_in_a_row = 0
        """Saves that failed (FailedSave) since the last committed one; the same on every
        rank."""
        self.store: CheckpointStore | None = None
        """Where checkpoints go when checkpoint.dir is a store URL (``directory`` is then
        the local staging directory); None for a local directory."""

    @property
    def writing(self) -> bool:
        """True while this rank's background write (async mode) is still running."""
        return self.pending is not None and not self.pending.future.done()

    def record_write_vote(self, any_writing: bool) -> None:
        """Keep the outcome of a vote every rank took together: was any rank still writing?

        The training step folds ``writing`` into its own world-wide reduction (as it does
        the stop vote) and hands the result here, so the next poll() needs no collective.
        """
        self._write_vote = None if self.pending is None else (self.pending, any_writing)

    def save(
        self,
        step: int,
        *,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        train_state: dict[str, Any],
        config_sha256: str = "",
    ) -> str:
        """Write checkpoint ``step_<step>``; return its final path. Collective.

        ``train_state`` holds plain types and tensors only (checked here, so a save never
        succeeds that a weights-only load would refuse). The saver adds ``step``, the
        scheduler's state_dict and, when absent, this rank's RNG state. Re-saving a step
        replaces its checkpoint without ``latest`` ever naming a missing one.

        Sync mode commits before returning. Async mode first waits for and commits the
        save in flight (raising its failure), copies model and optimizer state, starts
        the write and returns: the path exists only once poll(), wait() or the next
        save() has committed it. A write or commit that fails raises FailedSave (a
        CheckpointError naming the directory, the step and why, a full disk named as such)
        on every rank alike, after rank 0 has removed the partial ``step_<N>.tmp``; the
        previous checkpoint stays complete and ``latest`` stays on it, so the caller may
        go on and save again later.
        """
        self.finish_pending()
        started = time.monotonic()
        name = f"step_{step}"
        tmp = self.directory / f"{name}.tmp"
        state = self._coord.on_every_rank(
            lambda: build_train_state(step, scheduler.state_dict(), train_state)
        )
        self._raise_failed(step, self._coord.on_rank0(lambda: self._prepare(tmp, step)))
        # get_state_dict initializes an optimizer that has never stepped by taking a
        # zero-LR step; undo that so saving at step 0 does not change the run.
        fresh = not optimizer.state
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if fresh:
            optimizer.state.clear()
        rename_head_copy(model, optim_sd, to_saved=True)
        state["optimizer_initialized"] = not fresh
        # Serialized now: the bytes are the state at this call, whenever they are written.
        train_state_data = torch_bytes(state)
        # on_every_rank's agreement runs on the manager's group (the default one) from this
        # thread, right after _write started the background write, and so may poll()'s
        # fallback while the write is in flight. That write's own collectives (DCP's plan
        # exchange and its gather of the results) run on the side group from the writer
        # thread, and nothing on this thread uses the side group while a write is in
        # flight (the failure report and the teardown barrier come after wait()), so no
        # group ever carries collectives from two threads at once.
        writer = ChecksummingWriter(tmp)
        future, error = None, None
        try:
            future = self._write(
                {"model": model_sd, "optimizer": optim_sd}, writer, tmp, step, train_state_data
            )
        except FAILURES as e:
            error = e
        self._agree_on_write(step, error, writer.os_error, background=False)
        marker = self._marker(step, int(state.get("tokens_seen", 0)), config_sha256)
        path = self.location(name)
        if future is not None:
            self.pending = PendingSave(step, tmp, marker, future, started, lambda: writer.os_error)
            if self.rank == 0:
                logger.info(
                    "saving checkpoint %s in the background (%.2f s to stage)",
                    path,
                    time.monotonic() - started,
                )
            return path
        fault_save_delay(step)
        self._commit_or_fail(tmp, marker, background=False)
        elapsed = time.monotonic() - started
        if self.rank == 0:
            logger.info("saved checkpoint %s (%.2f s)", path, elapsed)
        self._committed(step, elapsed)
        return path

    def poll(self) -> str | None:
        """Commit the save in flight if its write has finished, without waiting for it.

        Returns the committed path, or None (nothing in flight, or still writing); raises
        CheckpointError when the background write failed. Cheap enough to call every
        step: nothing when no save is in flight; else it acts on the vote recorded since
        the last poll (record_write_vote), or, when none was, asks every rank with a
        one-integer all-reduce on the manager's group. Collective.
        """
        vote, self._write_vote = self._write_vote, None
        if self.pending is None:
            return None
        if vote is not None and vote[0] is self.pending:
            done = not vote[1]  # the step's reduction already asked every rank
        else:
            done = self._coord.all_true(self.pending.future.done())
        if not done:
            return None
        return self.finish_pending()

    def finish_pending(self) -> str | None:
        """Wait for the save in flight, if any, and commit it; return its path. Collective."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        error = None
        try:
            pending.future.result()
        except FAILURES as e:
            error = e
        self._agree_on_write(pending.step, error, pending.os_error(), background=True)
        self._commit_or_fail(pending.tmp, pending.marker, background=True)
        path = self.location(f"step_{pending.step}")
        elapsed = time.monotonic() - pending.started_s
        if self.rank == 0:
            logger.info("saved checkpoint %s (committed %.2f s after save)", path, elapsed)
        self._committed(pending.step, elapsed)
        return path

    def location(self, name: str) -> str:
        """Where checkpoint `name` (``step_<N>``) lives: its URL when checkpoint.dir is a
        store, else its directory. What save() returns and reports name."""
        return str(self.directory / name) if self.store is None else self.store.object_url(name)

    def _committed(self, step: int, elapsed: float) -> None:
        self.failed_saves_in_a_row = 0
        # Written whole by this run: retention trusts it (its staged path for a store).
        self.known_complete.add(self.directory / f"step_{step}")
        if self.store is not None:  # empty on a node without rank 0 (which removed its own)
            with contextlib.suppress(OSError):
                (self.directory / f"step_{step}.tmp").rmdir()
        if self.on_commit is not None:
            self.on_commit(step, self.location(f"step_{step}"), elapsed)

    def _marker(self, step: int, tokens_seen: int, config_sha256: str) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "step": step,
            "tokens_seen": tokens_seen,
            "world_size": self.world_size,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config_sha256": config_sha256 or self.config_sha256,
            "checksums": CHECKSUM_KIND,
        }

    def _write(
        self,
        state_dict: dict[str, Any],
        writer: ChecksummingWriter,
        tmp: Path,
        step: int,
        train_state_data: bytes,
    ) -> Future[None] | None:
        """Write the DCP files through `writer`, then this rank's train state and
        checksums: now, returning None, or in the background, returning the future of all
        three."""

        def then() -> None:
            write_rank_files(tmp, self.rank, train_state_data, writer.sums)
            if self.store is not None:
                upload_rank_files(self.store, tmp, self.rank, writer.sums)

        if self.store is not None:
            tmp.mkdir(parents=True, exist_ok=True)  # a node's staging rank 0 did not make

        if self.cfg.async_mode == "async":
            return self._writer.start(
                state_dict,
                writer,
                step=step,
                process_group=self._write_group(),
                no_dist=self._no_dist,
                then=then,
            )
        with quiet_single_process(self._no_dist):
            dcp_save(
                state_dict,
                storage_writer=writer,
                process_group=self.process_group,
                no_dist=self._no_dist,
            )
        then()
        return None

    def _write_group(self) -> dist.ProcessGroup | None:
        """The group background writes use: the side group, created here on first use
        (collective, as save() is) when the manager was given none."""
        if self.world_size > 1 and self._side_group is None:
            self._side_group = new_gloo_group(self.process_group)
        return self._side_group if self.world_size > 1 else self.process_group

    def _agree_on_write(
        self, step: int, error: BaseException | None, os_error: OSError | None, *, background: bool
    ) -> None:
        """Raise FailedSave on every rank when any rank's write of ``step_<step>`` failed,
        with the report of the rank that saw the OS error itself (else the lowest failing
        rank), after rank 0 has removed the partial ``step_<step>.tmp``. Collective: one
        all-reduce; a broadcast and the cleanup only after a failure."""
        local = None if error is None else diagnose(error, self.directory, os_error)
        firsthand = local is not None and local.firsthand
        agreed = self._coord.first_report(local, firsthand=firsthand)
        if agreed is not None:
            rank, diagnosis = agreed
            self._raise_failed(step, diagnosis, rank=rank, background=background)

    def _raise_failed(
        self,
        step: int,
        diagnosis: Diagnosis | None,
        *,
        rank: int = 0,
        background: bool = False,
    ) -> None:
        """Raise FailedSave for ``step_<step>`` when `diagnosis` (every rank's alike) says
        the save failed: first rank 0 frees what it left (a full disk needs the space
        back), then every rank raises the same report."""
        if diagnosis is None:
            return
        tmp = self.directory / f"step_{step}.tmp"
        self._coord.on_rank0(lambda: discard_partial(self.directory, tmp))
        if self.store is not None:  # what this node staged (rank 0's node: already gone)
            clear_local(tmp)
        self.failed_saves_in_a_row += 1
        reason = diagnosis.reason
        if self.world_size > 1 and "rank " not in reason:
            reason = f"rank {rank}: {reason}"
        latest = self._latest()
        kept = f"'{LATEST}' still names {latest}" if latest else "no earlier checkpoint exists"
        if self.store is not None and not latest:
            kept = f"'{LATEST}' was not moved"  # unread: the store may be what failed
        what = "the background write of" if background else "writing"
        where, target = self.directory, f"checkpoint step_{step} into {tmp}"
        if self.store is not None:
            where, target = self.store.url, f"checkpoint {self.location(f'step_{step}')}"
        raise FailedSave(
            where,
            step,
            f"{what} {target} failed, so it was not committed ({reason}); {kept}",
            reason=reason,
            bytes_free=diagnosis.bytes_free,
        )

    def _prepare(self, tmp: Path, step: int) -> Diagnosis | None:
        """Make ``step_<step>.tmp`` ready on rank 0; why not (an OS error), or None.

        A name the save must not replace (a link, a file) raises CheckpointError instead:
        that is no failed write but a directory to put right.
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            settle(self.directory)
            remove_leftovers(self.directory)
        except OSError as e:
            return diagnose(e, self.directory)
        check_names_free(self.directory, step)
        if self.store is not None:
            try:
                prepare_store_save(self.store, f"step_{step}")
            except StoreError as e:
                return Diagnosis(str(e))
        if tmp.exists():
            raise CheckpointError(tmp, f"'{LATEST}' names this directory, which a save reuses")
        try:
            tmp.mkdir()
        except OSError as e:
            return diagnose(e, self.directory)
        return None

    def _commit_or_fail(self, tmp: Path, marker: dict[str, Any], *, background: bool) -> None:
        """Commit on rank 0 (marker, rename, ``latest``, retention); a commit that an OS
        error stopped before ``latest`` moved raises FailedSave on every rank."""
        failure = self._coord.on_rank0(lambda: self._commit(tmp, marker))
        self._raise_failed(marker["step"], failure, background=background)

    def _commit(self, tmp: Path, marker: dict[str, Any]) -> Diagnosis | None:
        name = f"step_{marker['step']}"
        try:
            write_marker(tmp, marker)
            fsync_dir(tmp)  # entries of the DCP and train-state files, before the rename
            if self.store is not None:  # every rank's uploads are confirmed
                commit_to_store(self.store, tmp, self.known_complete, self.cfg)
                return None
            publish(self.directory, name)
        except StoreError as e:
            return Diagnosis(str(e))
        except OSError as e:
            return diagnose(e, self.directory)
        apply_retention(
            self.directory,
            keep_last_n=self.cfg.keep_last_n,
            keep_every=self.cfg.keep_every,
            is_complete=self._counts_as_complete,
        )
        return None

    def _latest(self) -> str | None:
        """What ``latest`` names, for a failure's report; for a store, what it named when
        this process last read or wrote it (no request to a store that may have failed)."""
        return read_latest(self.directory) if self.store is None else self.store.known_latest

    def _counts_as_complete(self, path: Path) -> bool:
        """For retention: a checkpoint this run wrote or verified, or else one with a
        marker; one small read, never a rank's files (a resume judges them)."""
        return path in self.known_complete or read_marker(path) is not None
