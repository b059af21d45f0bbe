"""The directories a run writes into: which it may take, its locks, and its config history.

A run writes only into its run directory (config.toml, config_history/, metrics.jsonl,
.lock) and its checkpoint directory (step_<N>/, latest, .lock). Before it writes anything
it checks that each is new, empty, or already one of its kind, and it locks both, so
two runs can share neither even when only their checkpoint.dir is the same.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import dump_config
from kempnerforge.config.run_config import RUN_CONFIG_FILE
from kempnerforge.core.errors import ConfigError, PeerSetupError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.resilience.run_lock import LOCK_NAME, RunLock

logger = get_logger(__name__)

CONFIG_HISTORY = "config_history"
_RUN_DIR_ENTRIES = {RUN_CONFIG_FILE, CONFIG_HISTORY, "metrics.jsonl", LOCK_NAME, "checkpoints"}
_CHECKPOINT_ENTRY = re.compile(r"latest|\.lock|step_\d+(\.(tmp|old|trash))?")


def _foreign_entries(path: Path, is_ours: re.Pattern[str] | set[str]) -> list[str]:
    """Names in an existing directory that a run of ours would not have written."""
    if not path.is_dir():
        return []
    names = sorted(os.listdir(path))
    if isinstance(is_ours, set):
        ours = [n for n in names if n in is_ours]
    else:
        ours = [n for n in names if is_ours.fullmatch(n)]
    # A directory holding any of our entries is one of ours: a run or a checkpoint
    # directory resumed later may also hold the user's notes, which we leave alone.
    return [] if ours else names


def check_directories(config: JobConfig) -> None:
    """Refuse a run directory or checkpoint directory that exists, is not empty and is
    not one a run wrote, unless train.use_existing_dir; ConfigError naming the field."""
    if config.train.use_existing_dir:
        return
    checks = [
        (
            "train.run_dir" if config.train.run_dir else "train.name",
            config.run_dir,
            _RUN_DIR_ENTRIES,
        ),
        ("checkpoint.dir", config.checkpoint_dir, _CHECKPOINT_ENTRY),
    ]
    for field, directory, ours in checks:
        path = Path(directory)
        if path.exists() and not path.is_dir():
            raise ConfigError(field, directory, "a directory", "a file of that name exists")
        foreign = _foreign_entries(path, ours)
        if foreign:
            shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
            raise ConfigError(
                field,
                directory,
                "a new or empty directory, or one a previous run wrote",
                f"it already holds {len(foreign)} other entries ({shown}); choose another "
                "directory, or set train.use_existing_dir=true to write into it anyway",
            )


@contextlib.contextmanager
def locked_directories(config: JobConfig) -> Iterator[contextlib.ExitStack]:
    """Hold the run directory's and the checkpoint directory's locks (rank 0 calls this).

    A replica group locks its own run directory (replica_<id>) only: the job's groups
    share the checkpoint directory, and one group writes each checkpoint.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(RunLock(config.run_dir))
        if not config.fault_tolerance.enabled:
            stack.enter_context(
                RunLock(config.checkpoint_dir, what="checkpoint directory", field="checkpoint.dir")
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
                stack.enter_context(locked_directories(config))
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
