"""CheckpointManager: atomic DCP checkpoints, the `latest` pointer, retention and resume.

On disk, under the checkpoint directory::

    latest                    text file naming the newest committed checkpoint ("step_30")
    step_30/                  one committed checkpoint
        .metadata, *.distcp   DCP files of {"model": ..., "optimizer": ...}, FQN keyed
        train_state_rank<R>.pt  torch.save of rank R's plain-typed train state
        complete.json         completion marker, written last
    step_40.tmp/              a save in progress (or left by a crash; removed by the next save)

A save fills ``step_<N>.tmp/``, writes the marker, renames the directory to ``step_<N>/``
and only then moves ``latest``, so a crash at any point leaves ``latest`` on a complete
checkpoint. Rank 0 does every rename and deletion; the other ranks wait for it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from kempnerforge.checkpoint.layout import (
    FORMAT_VERSION,
    LATEST,
    LEFTOVER_DIR,
    build_train_state,
    checkpoint_problems,
    fsync_dir,
    inspect_checkpoint,
    is_checkpoint_name,
    read_latest,
    read_marker,
    step_dirs,
    train_state_name,
    write_latest,
    write_marker,
    write_torch,
)
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.metrics.logging import get_logger

logger = get_logger(__name__)

_T = TypeVar("_T")


class CheckpointError(Exception):
    """A checkpoint cannot be saved, found or loaded; names the path and what is wrong."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class CheckpointManager:
    """Saves, finds and loads this run's checkpoints (see the module docstring for layout).

    Every rank constructs one and calls save/load/find_resume_path together: those are
    collective when world_size > 1 (``rank`` is the rank in ``process_group``, the default
    group when None). The directory must be one shared filesystem path for all ranks.
    ``config_sha256`` is recorded in each marker unless a save passes its own.
    """

    def __init__(
        self,
        cfg: CheckpointConfig,
        directory: str,
        *,
        rank: int = 0,
        world_size: int = 1,
        process_group: dist.ProcessGroup | None = None,
        config_sha256: str = "",
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        if world_size > 1 and not initialized:
            raise ValueError(f"world_size={world_size} needs torch.distributed to be initialized")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world_size {world_size}")
        self.cfg = cfg
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.process_group = process_group
        self.config_sha256 = config_sha256
        self._no_dist = not initialized

    def is_on_schedule(self, step: int) -> bool:
        """True when `step` is a positive multiple of checkpoint.interval (never if it is 0)."""
        return self.cfg.interval > 0 and step > 0 and step % self.cfg.interval == 0

    def should_save(self, step: int, max_steps: int) -> bool:
        """True when the loop should save after `step`: on schedule and within the run.

        The end of the run is not included: the loop saves there itself when the last
        step is off schedule (or interval is 0), so each step is saved at most once.
        """
        return self.is_on_schedule(step) and step <= max_steps

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
        """Write and commit checkpoint ``step_<step>``; return its path. Collective.

        ``train_state`` holds plain types and tensors only (checked here, so a save never
        succeeds that a weights-only load would refuse). The manager adds ``step``, the
        scheduler's state_dict and, when absent, this rank's RNG state. Re-saving a step
        replaces its checkpoint without ``latest`` ever naming a missing one.
        """
        started = time.monotonic()
        name = f"step_{step}"
        tmp = self.directory / f"{name}.tmp"
        state = self._on_every_rank(
            lambda: build_train_state(step, scheduler.state_dict(), train_state)
        )
        self._on_rank0(lambda: self._prepare(tmp))
        # get_state_dict initializes an optimizer that has never stepped by taking a
        # zero-LR step; undo that so saving at step 0 does not change the run.
        fresh = not optimizer.state
        model_sd, optim_sd = get_state_dict(model, optimizer)
        if fresh:
            optimizer.state.clear()
        state["optimizer_initialized"] = not fresh
        with self._quiet_single_process():
            dcp_save(
                {"model": model_sd, "optimizer": optim_sd},
                checkpoint_id=str(tmp),
                process_group=self.process_group,
                no_dist=self._no_dist,
            )
        self._on_every_rank(lambda: write_torch(tmp / train_state_name(self.rank), state))
        marker = {
            "format_version": FORMAT_VERSION,
            "step": step,
            "tokens_seen": int(state.get("tokens_seen", 0)),
            "world_size": self.world_size,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config_sha256": config_sha256 or self.config_sha256,
        }
        self._on_rank0(lambda: self._commit(tmp, marker))
        path = self.directory / name
        if self.rank == 0:
            logger.info("saved checkpoint %s (%.2f s)", path, time.monotonic() - started)
        return str(path)

    def wait(self) -> None:
        """Block until every save issued so far is durable and committed.

        Saves are synchronous today, so this returns at once; the loop calls it before
        returning so that asynchronous saves can be added without changing callers.
        """

    def _prepare(self, tmp: Path) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self._settle()
        latest = read_latest(self.directory)
        for path in self.directory.iterdir():
            if LEFTOVER_DIR.fullmatch(path.name) and path.name != latest:
                logger.info("removing %s, left by an interrupted save", path)
                shutil.rmtree(path)
        if tmp.exists():
            raise CheckpointError(tmp, f"'{LATEST}' names this directory, which a save reuses")
        tmp.mkdir()

    def _commit(self, tmp: Path, marker: dict[str, Any]) -> None:
        write_marker(tmp, marker)
        fsync_dir(tmp)  # entries of the DCP and train-state files, before the rename
        self._publish(f"step_{marker['step']}")
        self._apply_retention()

    def _publish(self, name: str) -> None:
        """Move a marked ``<name>.tmp`` into place as ``<name>`` and point ``latest`` at it.

        Also finishes a publish a crash interrupted. When ``<name>`` already exists it is
        swapped out through ``<name>.old``, with ``latest`` always naming a marked copy.
        """
        final, tmp, old = (self.directory / f"{name}{s}" for s in ("", ".tmp", ".old"))
        if read_marker(tmp) is not None:
            if final.exists():
                if read_latest(self.directory) in (final.name, old.name):
                    write_latest(self.directory, tmp.name)
                if old.exists():
                    shutil.rmtree(old)
                os.replace(final, old)
                fsync_dir(self.directory)
            if read_latest(self.directory) == tmp.name and read_marker(old) is not None:
                write_latest(self.directory, old.name)
            os.replace(tmp, final)
            fsync_dir(self.directory)
        if read_marker(final) is not None:
            write_latest(self.directory, final.name)
            if old.exists():
                shutil.rmtree(old)

    def _settle(self) -> None:
        """Finish a publish that a crash left with ``latest`` on a .tmp or .old copy."""
        match = LEFTOVER_DIR.fullmatch(read_latest(self.directory) or "")
        if match:
            self._publish(f"step_{match.group(1)}")

    def _apply_retention(self) -> None:
        keep = self.cfg.keep_last_n
        if keep == 0:
            return
        latest = read_latest(self.directory)
        complete = [p for _, p in step_dirs(self.directory) if self.is_complete(p)]
        for path in complete[keep:]:
            if path.name == latest:
                continue
            # Rename first: a half-deleted directory must never look like a checkpoint.
            trash = path.with_name(f"{path.name}.trash")
            os.replace(path, trash)
            shutil.rmtree(trash)
            logger.info("removed old checkpoint %s (checkpoint.keep_last_n = %d)", path, keep)

    def find_resume_path(self) -> str | None:
        """The checkpoint checkpoint.resume_from selects, or None to start fresh. Collective.

        'none' gives None. A path must be a complete checkpoint (a name relative to the
        checkpoint directory also works). 'auto' takes the one ``latest`` names if it is
        complete, otherwise the newest complete ``step_<N>`` (warning which were skipped),
        and None when the directory holds no checkpoint at all; when it holds only broken
        ones this raises, rather than silently starting over.
        """
        return self._on_rank0(self._resolve)

    def _resolve(self) -> str | None:
        choice = self.cfg.resume_from
        if choice == "none":
            return None
        if choice != "auto":
            path = Path(choice)
            if not path.exists() and (self.directory / choice).exists():
                path = self.directory / choice
            _raise_if_incomplete(path)
            return str(path)
        skipped: list[str] = []
        latest = read_latest(self.directory)
        if latest is not None:
            path = self.directory / latest
            problems = (
                checkpoint_problems(path) if is_checkpoint_name(latest) else ["not a step name"]
            )
            if not problems:
                return str(path)
            skipped.append(f"{path} named by '{LATEST}' ({problems[0]})")
        candidates = step_dirs(self.directory)
        for _, path in candidates:
            if path.name == latest:
                continue
            problems = checkpoint_problems(path)
            if not problems:
                reason = f"skipped {'; '.join(skipped)}" if skipped else f"no '{LATEST}' file"
                logger.warning(
                    "resuming from %s, the newest complete checkpoint (%s)", path, reason
                )
                return str(path)
            skipped.append(f"{path} ({problems[0]})")
        if candidates:
            # Broken checkpoints are not "nothing": starting over would silently drop them.
            raise CheckpointError(
                self.directory,
                f"no complete checkpoint to resume from (skipped {'; '.join(skipped)}); "
                "set checkpoint.resume_from = 'none' to start over",
            )
        if skipped:
            logger.warning("no checkpoint to resume from: skipped %s", skipped[0])
        return None

    def is_complete(self, path: str | os.PathLike[str]) -> bool:
        """True when `path` holds a committed, intact checkpoint.

        The marker parses, every saved rank's train state is a whole file, DCP's
        ``.metadata`` loads through an allow-list and no file it references is short.
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
        rank 0's train state, with a warning. Collective.
        """
        root = Path(path)
        state, saved = self._on_every_rank(lambda: self._read_train_state(root))
        self._load_model_and_optimizer(root, model, optimizer, saved)
        try:
            scheduler.load_state_dict(state["scheduler"])
        except Exception as e:
            raise CheckpointError(root, f"the scheduler state does not fit: {e}") from e
        if not state.get("optimizer_initialized", True):
            optimizer.state.clear()  # saved before the first step: see save
        if self.rank == 0:
            logger.info("loaded checkpoint %s (step %d)", root, state["step"])
        return state

    def _read_train_state(self, root: Path) -> tuple[dict[str, Any], set[str]]:
        """This rank's train state and the keys the DCP files hold, after checking `root`."""
        metadata = _raise_if_incomplete(root)
        marker = read_marker(root) or {}
        saved_world_size = int(marker.get("world_size", 1))
        if saved_world_size != self.world_size and self.rank == 0:
            logger.warning(
                "%s was saved by %d ranks and this run has %d: model and optimizer are "
                "resharded, but dataloader positions and RNG are per rank and ranks >= %d "
                "take rank 0's",
                root,
                saved_world_size,
                self.world_size,
                saved_world_size,
            )
        file = root / train_state_name(self.rank if self.rank < saved_world_size else 0)
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:
            raise CheckpointError(file, f"cannot be read as a weights-only torch file: {e}") from e
        if not isinstance(state, dict) or state.get("step") != marker.get("step"):
            raise CheckpointError(file, f"is not the train state of step {marker.get('step')}")
        return state, set(metadata.state_dict_metadata)

    def _load_model_and_optimizer(
        self,
        root: Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        saved: set[str],
    ) -> None:
        # get_state_dict creates the optimizer state DCP loads into, but only when no
        # parameter holds a gradient; stale gradients mean nothing after a load anyway.
        optimizer.zero_grad(set_to_none=True)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        unknown = sorted(k for k in saved if k.startswith("model.") and k[6:] not in model_sd)
        if unknown:
            raise CheckpointError(
                root,
                f"{len(unknown)} saved model entries do not exist in this model (first: "
                f"{unknown[0]}); was it saved from another model config?",
            )
        if not optim_sd.get("state") and any(k.startswith("optimizer.state.") for k in saved):
            raise CheckpointError(root, "the optimizer has no state to load the saved one into")
        to_load = {"model": model_sd, "optimizer": optim_sd}
        try:
            with self._quiet_single_process():
                dcp_load(
                    to_load,
                    checkpoint_id=str(root),
                    process_group=self.process_group,
                    no_dist=self._no_dist,
                )
        except Exception as e:
            raise CheckpointError(root, f"model/optimizer do not load: {e}") from e
        set_state_dict(
            model,
            optimizer,
            model_state_dict=to_load["model"],
            optim_state_dict=to_load["optimizer"],
        )

    def _on_rank0(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on rank 0 only; every rank returns its result or raises its error."""
        if self.world_size == 1:
            return fn()
        outcome: list[Any] = [None]
        error: Exception | None = None
        if self.rank == 0:
            try:
                outcome = [("ok", fn())]
            except Exception as e:
                error, outcome = e, [("error", str(e))]
        dist.broadcast_object_list(outcome, group=self.process_group, group_src=0)
        kind, value = outcome[0]
        if error is not None:
            raise error
        if kind == "error":
            raise CheckpointError(self.directory, f"rank 0 failed: {value}")
        return value

    def _on_every_rank(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on every rank and return its result; if any rank fails, every rank raises."""
        error: Exception | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as e:
            error = e
        if self.world_size > 1:
            errors: list[Any] = [None] * self.world_size
            dist.all_gather_object(
                errors, None if error is None else str(error), self.process_group
            )
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed and error is None:
                rank, message = failed[0]
                raise CheckpointError(self.directory, f"rank {rank} failed: {message}")
        if error is not None:
            raise error
        return result

    @contextlib.contextmanager
    def _quiet_single_process(self) -> Iterator[None]:
        """Silence DCP's 'assuming ... single process' warning: that is our intent."""
        with warnings.catch_warnings():
            if self._no_dist:
                warnings.filterwarnings("ignore", message=r".*assuming the intent is to .*")
            yield


def _raise_if_incomplete(path: Path) -> Metadata:
    """DCP metadata of checkpoint `path`; CheckpointError naming what is missing if broken."""
    problems, metadata = inspect_checkpoint(path)
    if problems or metadata is None:
        raise CheckpointError(path, "not a complete checkpoint: " + "; ".join(problems))
    return metadata
