"""Which checkpoint a launch resumes from, and loading it into a built session.

The rule, checked before anything is built: a run's own checkpoint directory wins. When
it holds a complete checkpoint, the run resumes fully from the newest one, whatever
checkpoint.resume_from and checkpoint.load_weights_only say: those name where a run
*starts*, and a requeued run must continue, not start again. Only a run without
checkpoints of its own loads an explicit checkpoint.resume_from (fully, or its weights
alone with load_weights_only). resume_from = "none" always starts afresh.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kempnerforge.checkpoint.disk_format import read_marker
from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.checkpoint.memory_tier import MemoryTier, agreed_step, restore
from kempnerforge.checkpoint.store import CheckpointStoreError
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.metrics.profiling import build_profiler
from kempnerforge.optim.optimizer import set_optimizer_mode
from kempnerforge.training.families import family_of
from kempnerforge.training.freeze import check_saved_freeze
from kempnerforge.training.lr import refresh_learning_rates
from kempnerforge.training.resume_guard import check_config_changes
from kempnerforge.training.session import TrainingSession
from kempnerforge.training.state import restore_train_state

logger = get_logger(__name__)

FULL, WEIGHTS, FRESH_OPTIMIZER = "full", "weights", "fresh_optimizer"

# Optimizer group entries that come from the config, not from training: after a load they
# are set back to this launch's values, so a changed hyperparameter takes effect. Entries
# a group accumulates while training (schedule-free's step count, weight sum) stay loaded.
CONFIG_GROUP_KEYS = (
    "initial_lr",
    "weight_decay",
    "betas",
    "eps",
    "momentum",
    "ns_steps",
    "warmup_steps",
    "foreach",
    "fused",
)


@dataclass(frozen=True)
class ResumePlan:
    """A checkpoint to load and how: FULL, WEIGHTS (model only, step 0) or FRESH_OPTIMIZER
    (everything but the optimizer state); ``step`` is the checkpoint's. ``path`` is what
    the checkpointer loads (a store's checkpoint: its staged copy), ``where`` what reports
    name (a store's checkpoint: its URL)."""

    path: str
    mode: str
    step: int
    where: str = ""

    def __post_init__(self) -> None:
        if not self.where:
            object.__setattr__(self, "where", self.path)


def plan_resume(config: JobConfig, checkpointer: CheckpointManager) -> ResumePlan | None:
    """The checkpoint this launch resumes from and how, or None to start at step 0.

    Reads markers and train-state files only. Raises ConfigError for a config change the
    checkpoint refuses, for a checkpoint past train.max_steps (one exactly at it has
    nothing left to train: the caller says so), and for a link or file in the checkpoint
    directory where this run may have to save (see check_save_names); CheckpointError
    for a named checkpoint that is broken.
    """
    plan = _choose_plan(config, checkpointer)
    first_step = plan.step if plan is not None and plan.mode != WEIGHTS else 0
    check_save_names(checkpointer, first_step, config.train.max_steps)
    return plan


def check_save_names(checkpointer: CheckpointManager, first_step: int, max_steps: int) -> None:
    """Refuse, before anything is built, a checkpoint directory where a save this run may
    make (any step after `first_step` up to `max_steps`: on schedule, at the end, or at a
    stop signal) would meet a link or file it must not replace.

    A ``step_<N>`` linked into the checkpoint directory (to start from another run's
    checkpoint) is never followed, so without this check the run would train N steps and
    then stop at the save of step N with those steps lost. ConfigError naming
    checkpoint.dir, the entry, and what to do instead.
    """
    problems = checkpointer.names_blocking_saves(first_step, max_steps)
    if not problems:
        return
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    raise ConfigError(
        "checkpoint.dir",
        str(checkpointer.directory),
        "only checkpoints this run saves under the step_<N> names it may save",
        f"{problems[0]}{more}, and this run may save any step from {first_step + 1} to "
        f"{max_steps}; a run never follows or replaces a link or file among its "
        "checkpoints: move it away, and to start from another run's checkpoint set "
        "checkpoint.resume_from to its path instead",
    )


def _choose_plan(config: JobConfig, checkpointer: CheckpointManager) -> ResumePlan | None:
    cfg = config.checkpoint
    if cfg.resume_from == "none":
        _warn_unused(checkpointer)
        return None
    own = checkpointer.newest_complete_path()
    if own is not None:
        if cfg.resume_from != "auto" or cfg.load_weights_only:
            logger.info(
                "resuming from %s, the newest checkpoint of this run: a run's own checkpoints "
                "win over checkpoint.resume_from = %r%s, which only name where a run starts",
                checkpointer.location_of(own),
                cfg.resume_from,
                " and checkpoint.load_weights_only" if cfg.load_weights_only else "",
            )
        path, mode = own, FULL
    else:
        found = checkpointer.find_resume_path()  # raises when only broken checkpoints exist
        if found is None:
            return None
        path, mode = found, WEIGHTS if cfg.load_weights_only else FULL
    extra = checkpointer.read_extra(path)
    step = int(extra.get("step", 0))
    where = checkpointer.location_of(path)
    if mode == WEIGHTS:
        return ResumePlan(path, mode, step, where)
    marker = read_marker(Path(path)) or {}
    if check_config_changes(
        config,
        extra.get("config"),
        where,
        saved_world_size=int(marker.get("world_size", 1)),
        world_size=checkpointer.world_size,
    ):
        mode = FRESH_OPTIMIZER
    schedule = family_of(config).freeze_schedule(config)
    check_saved_freeze(extra.get("vlm_freeze"), schedule, step, where)
    max_steps = config.train.max_steps
    if step > max_steps:
        raise ConfigError(
            "train.max_steps",
            max_steps,
            f">= {step}, the step of the checkpoint {where} this run resumes",
            "nothing to train: raise --train.max_steps to continue this run, or use another "
            "train.name to start a new one",
        )
    return ResumePlan(path, mode, step, where)


def _warn_unused(checkpointer: CheckpointManager) -> None:
    """checkpoint.resume_from = 'none': warn when the run's checkpoints will be replaced
    (a store that cannot say is no reason not to start over)."""
    try:
        own = checkpointer.newest_complete_path()
    except CheckpointStoreError as error:
        logger.warning("checkpoint.resume_from = 'none': starting at step 0 (%s)", error)
        return
    if own is not None:
        logger.warning(
            "checkpoint.resume_from = 'none': starting at step 0 although %s holds "
            "checkpoints (newest %s); this run's saves will replace them",
            checkpointer.location_of(checkpointer.directory),
            checkpointer.location_of(own),
        )


def _config_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [
        {k: group[k] for k in CONFIG_GROUP_KEYS if k in group} for group in optimizer.param_groups
    ]


def apply_resume(session: TrainingSession, plan: ResumePlan | None) -> tuple[int, int]:
    """Load `plan` into the session; return (step, tokens_seen), (0, 0) without a plan.

    With a memory tier (checkpoint.memory_interval), its newest copy every rank holds wins
    when it is newer than the plan's checkpoint: each rank reads its own share back from
    host memory. After the load every optimizer group takes this launch's hyperparameters
    (see CONFIG_GROUP_KEYS) and its LR is recomputed from this launch's schedule at the
    resumed step, so the first step after a resume already uses the new values.
    """
    checkpointer, model, cfg = session.checkpointer, session.model, session.config
    tier = session.memory_tier
    memory_step = newer_memory_step(tier, cfg.checkpoint, session.runtime, plan)
    if plan is None and memory_step is None:
        return 0, 0
    configured = _config_hyperparameters(session.optimizer)
    if memory_step is not None:
        assert tier is not None
        began = time.perf_counter()
        where = f"the memory tier's copy of step {memory_step} ({tier.root})"
        if (keeper := tier.fetch(memory_step)) is not None:  # this node lost its copy
            where = f"the memory tier's copy of step {memory_step}, kept by rank {keeper}"
            logger.warning(
                "memory tier: rank %d held no copy of step %d (its node's memory was lost); "
                "took the one rank %d kept on its node",
                session.runtime.rank,
                memory_step,
                keeper,
            )
        saved = tier.load(memory_step)
        # The copy's config against this launch's, as a checkpoint's is (resume_guard.py);
        # a copy holds no other layout's shards, so it never resets the optimizer.
        recorded = saved["train_state"].get("extra", {}).get("config")
        world = session.runtime.world_size
        check_config_changes(cfg, recorded, where, saved_world_size=world, world_size=world)
        state = restore(saved, model, session.optimizer, session.scheduler)
        logger.info("memory tier: read back in %.3f s", time.perf_counter() - began)
    else:
        assert plan is not None
        where = plan.where
        if plan.mode == WEIGHTS:
            checkpointer.load_weights(plan.path, model=model)
            session.tracker.log_event(0, "load_weights", path=plan.where)
            logger.info("initialised the model from %s (weights only); starting at step 0", where)
            return 0, 0
        state = _load_plan(
            checkpointer, plan, model, session.optimizer, session.scheduler, cfg.optimizer.name
        )
    for group, values in zip(session.optimizer.param_groups, configured, strict=True):
        group.update(values)
    set_optimizer_mode(session.optimizer, True)  # checkpoints hold a schedule-free eval point
    try:
        step, tokens_seen = restore_train_state(session, state)
    except DataError as error:
        raise DataError(f"{where}: {error}") from None  # name the checkpoint
    refresh_learning_rates(session)
    session.profiler = build_profiler(
        cfg.profiling, cfg.run_dir, first_step=step, rank=session.runtime.rank
    )
    session.tracker.log_event(step, "resume", path=where, tokens_seen=tokens_seen)
    logger.info("resumed from %s at step %d (%d tokens seen)", where, step, tokens_seen)
    return step, tokens_seen


def _load_plan(
    checkpointer: CheckpointManager,
    plan: ResumePlan,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    optimizer_name: str,
) -> dict[str, Any]:
    """Load a full or fresh-optimizer plan's checkpoint; its train state."""
    if plan.mode == FULL:
        return checkpointer.load(plan.path, model=model, optimizer=optimizer, scheduler=scheduler)
    checkpointer.load_weights(plan.path, model=model)
    state = checkpointer.read_train_state(plan.path)
    scheduler.last_epoch = int(state["step"])
    logger.warning(
        "resumed %s with a fresh %s optimizer state (checkpoint.reset_optimizer)",
        plan.where,
        optimizer_name,
    )
    return state


def newer_memory_step(
    tier: MemoryTier | None,
    cfg: CheckpointConfig,
    runtime: RuntimeContext,
    plan: ResumePlan | None,
) -> int | None:
    """The step of the memory tier's newest copy every rank holds, when it is newer than
    what ``plan`` resumes (a full or fresh-optimizer resume's step; a weights-only start is
    step 0); None otherwise, without a memory tier, or with resume_from = 'none'.
    Collective over every rank."""
    if tier is None or cfg.resume_from == "none":
        return None
    step = agreed_step(tier, runtime.group("world"), runtime.device)
    resumed = plan.step if plan is not None and plan.mode != WEIGHTS else 0
    return step if step is not None and step > resumed else None


def resume_session(session: TrainingSession) -> tuple[int, int]:
    """plan_resume then apply_resume on a built session; (step, tokens_seen)."""
    return apply_resume(session, plan_resume(session.config, session.checkpointer))
