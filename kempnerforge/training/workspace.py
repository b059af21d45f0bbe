"""The directories a run writes into: which it may take, its locks, and its config history.

A run writes only into its run directory (.kempnerforge-run, config.toml, config_history/,
metrics.jsonl, hangs/, .lock) and its checkpoint directory (step_<N>/, latest, .lock).
Before it writes anything it checks that each is new, empty, or already one of its kind,
and it locks both, so two runs can share neither even when only their checkpoint.dir is
the same.

A run directory is one of ours only when it holds the marker ``.kempnerforge-run``, which
a run writes when it claims the directory: file names such as config.toml or
metrics.jsonl are common in project folders, and a run must never take such a folder for
a previous run and overwrite them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from kempnerforge.checkpoint.disk_format import is_real_dir, read_latest, read_marker, step_dirs
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import dump_config
from kempnerforge.config.run_config import RUN_CONFIG_FILE
from kempnerforge.core.errors import ConfigError, PeerSetupError
from kempnerforge.core.logging import get_logger
from kempnerforge.core.metrics_file import METRICS_FILE
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.resilience.run_lock import LOCK_NAME, RunLock
from kempnerforge.storage.location import is_url

logger = get_logger(__name__)

CONFIG_HISTORY = "config_history"
RUN_MARKER = ".kempnerforge-run"
"""Written by a run into the run directory it claims (JSON: format_version, name, created)."""
MARKER_FORMAT = 1
_RUN_FILES = (RUN_CONFIG_FILE, METRICS_FILE, CONFIG_HISTORY)
"""What a run writes that a directory of someone else's may hold under the same name."""
_CHECKPOINT_ENTRY = re.compile(r"latest|\.lock|step_\d+(\.(tmp|old|trash))?")


def _foreign_entries(path: Path, is_ours: re.Pattern[str]) -> list[str]:
    """Names in an existing checkpoint directory that a run of ours would not have written."""
    if not path.is_dir():
        return []
    names = sorted(os.listdir(path))
    ours = [n for n in names if is_ours.fullmatch(n)]
    # A directory holding any of our entries is one of ours: a checkpoint directory
    # resumed later may also hold the user's notes, which we leave alone.
    return [] if ours else names


def check_directories(config: JobConfig) -> None:
    """Refuse a run directory or checkpoint directory that exists, is not empty and is
    not one a run wrote, unless train.use_existing_dir; ConfigError naming the field.

    A run directory is a previous run's when it holds RUN_MARKER, or when an earlier
    version made it (no marker, but metrics.jsonl and a complete checkpoint: see
    _is_earlier_run). Even with train.use_existing_dir, a directory holding a
    config.toml, metrics.jsonl or config_history/ that no run made is refused, as the run
    would overwrite them.
    """
    run_field = "train.run_dir" if config.train.run_dir else "train.name"
    _check_run_dir(
        run_field, Path(config.run_dir), config.checkpoint_dir, config.train.use_existing_dir
    )
    if config.train.use_existing_dir or is_url(config.checkpoint_dir):
        return  # a store holds no foreign entries a save would overwrite: only step_<N>
    path = Path(config.checkpoint_dir)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            "checkpoint.dir", config.checkpoint_dir, "a directory", "a file of that name exists"
        )
    foreign = _foreign_entries(path, _CHECKPOINT_ENTRY)
    if foreign:
        raise _foreign_error("checkpoint.dir", config.checkpoint_dir, foreign)


def _foreign_error(field: str, directory: str, foreign: list[str]) -> ConfigError:
    shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
    return ConfigError(
        field,
        directory,
        "a new or empty directory, or one a previous run wrote",
        f"it already holds {len(foreign)} other entries ({shown}); choose another "
        "directory, or set train.use_existing_dir=true to write into it anyway",
    )


def _check_run_dir(field: str, path: Path, checkpoint_dir: str, use_existing_dir: bool) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(field, str(path), "a directory", "a file of that name exists")
    names = sorted(n for n in os.listdir(path) if n != LOCK_NAME) if path.is_dir() else []
    if not names or RUN_MARKER in names or _is_earlier_run(path, Path(checkpoint_dir)):
        return
    lookalikes = [n for n in names if n in _RUN_FILES]
    if lookalikes:
        raise ConfigError(
            field,
            str(path),
            f"a new or empty directory, or one a run made (it holds {RUN_MARKER})",
            f"it holds {', '.join(lookalikes)} but no {RUN_MARKER}, so no run wrote "
            f"{'them' if len(lookalikes) > 1 else 'it'}, and a run would overwrite "
            f"{'them' if len(lookalikes) > 1 else 'it'} (train.use_existing_dir too): choose "
            "another directory or move them away (to continue a run of an earlier version "
            f"that wrote them, create an empty {RUN_MARKER} there)",
        )
    if not use_existing_dir:
        raise _foreign_error(field, str(path), names)


def _is_earlier_run(path: Path, checkpoints: Path) -> bool:
    """Whether `path`, without a marker, is a run an earlier version made: it holds
    metrics.jsonl and the checkpoint directory holds a checkpoint with a valid completion
    marker (the one ``latest`` names, else the newest that has one: one small read each).
    Such a run resumes; the launch then marks the directory (mark_run_dir)."""
    if not (path / METRICS_FILE).is_file():
        return False
    latest = read_latest(checkpoints)
    candidates = [checkpoints / latest] if latest else []
    candidates += [p for _, p in step_dirs(checkpoints)]
    found = next((p for p in candidates if is_real_dir(p) and read_marker(p)), None)
    if found is not None:
        logger.info(
            "taking %s for a run of an earlier version (no %s; it holds %s and %s): marking it",
            path,
            RUN_MARKER,
            METRICS_FILE,
            found,
        )
    return found is not None


def mark_run_dir(run_dir: str, name: str) -> None:
    """Write RUN_MARKER into ``run_dir``, unless it is there: from now on the directory is
    known to be a run's (``name``: train.name). Rank 0, after the checks and the locks."""
    marker = Path(run_dir) / RUN_MARKER
    if marker.exists():
        return
    marker.parent.mkdir(parents=True, exist_ok=True)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    text = {"format_version": MARKER_FORMAT, "name": name, "created": created}
    _write_atomic(marker, json.dumps(text) + "\n")


@contextlib.contextmanager
def locked_directories(run_dir: str, checkpoint_dir: str | None) -> Iterator[contextlib.ExitStack]:
    """Hold the run directory's lock and, unless ``checkpoint_dir`` is None, the checkpoint
    directory's (rank 0 calls this).

    A replica group locks its own run directory (replica_<id>) only: the job's groups
    share the checkpoint directory, and one group writes each checkpoint.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(RunLock(run_dir))
        if checkpoint_dir is not None:
            stack.enter_context(
                RunLock(checkpoint_dir, what="checkpoint directory", field="checkpoint.dir")
            )
        yield stack


@contextlib.contextmanager
def rank0_workspace(config: JobConfig, runtime: RuntimeContext) -> Iterator[None]:
    """Rank 0 checks and locks the run's directories (check_directories,
    locked_directories) for the whole block; every rank learns whether that worked.

    Collective when distributed: one broadcast from rank 0, before any other collective,
    so a refused directory or a held lock stops every rank at once with rank 0's reason
    instead of leaving the others waiting in the checkpointer's first collective until
    distributed.timeout_s.
    """
    failure: BaseException | None = None
    with contextlib.ExitStack() as stack:
        if runtime.is_main:
            try:
                check_directories(config)
                # A replica group shares the job's checkpoint directory with the others.
                shared = config.fault_tolerance.enabled
                # A store cannot be locked: two runs must not share a checkpoint.dir URL.
                in_store = is_url(config.checkpoint_dir)
                checkpoints = None if shared or in_store else config.checkpoint_dir
                stack.enter_context(locked_directories(config.run_dir, checkpoints))
                mark_run_dir(config.run_dir, config.train.name)
            except Exception as e:
                failure = e
        if runtime.is_distributed:
            outcome: list[str | None] = [None if failure is None else str(failure)]
            dist.broadcast_object_list(outcome, src=0)
            if failure is None and outcome[0] is not None:
                raise PeerSetupError(f"rank 0 could not set up the run: {outcome[0]}")
        if failure is not None:
            raise failure
        yield


def record_config(config: JobConfig, started: float | None = None) -> str:
    """Write the resolved config as config.toml and into config_history/; return the
    history file's path.

    config.toml is always this launch's config (``kempnerforge train runs/x/config.toml``
    reruns it); config_history/ keeps one file per launch, named by its start time in UTC,
    so the settings every part of a resumed run trained with stay recoverable.
    """
    text = dump_config(config)
    run_dir = Path(config.run_dir)
    history = run_dir / CONFIG_HISTORY
    history.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started or time.time()))
    entry = history / f"config-{stamp}.toml"
    suffix = 1
    while entry.exists():  # two launches in one second
        suffix += 1
        entry = history / f"config-{stamp}-{suffix}.toml"
    _write_atomic(entry, text)
    _write_atomic(run_dir / RUN_CONFIG_FILE, text)
    return str(entry)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, e.strerror, str(path)) from e
