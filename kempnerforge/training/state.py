"""The train state a checkpoint carries beside model and optimizer, and putting it back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state
from kempnerforge.config.errors import ConfigError
from kempnerforge.metrics.logging import get_logger
from kempnerforge.resilience.nan import NaNAbortError
from kempnerforge.training.optimizer import set_optimizer_mode

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig
    from kempnerforge.training.loop import TrainingSession

logger = get_logger(__name__)


def capture_train_state(
    session: TrainingSession, step: int, tokens_seen: int, extra: dict[str, Any]
) -> dict[str, Any]:
    """Everything besides weights and optimizer that a resume needs to continue exactly."""
    return {
        "step": step,
        "tokens_seen": tokens_seen,
        "dataloader": session.data.state_dict(),
        "rng": capture_rng_state(),
        "nan_detector": session.nan_detector.state_dict(),
        "extra": extra,
    }


def restore_train_state(
    session: TrainingSession, state: dict[str, Any], *, keep_live_position: bool = False
) -> tuple[int, int]:
    """Put a loaded train state back into the session; return (step, tokens_seen).

    The RNG is restored last, after everything that might draw random numbers while
    being rebuilt, so the next step draws exactly what the uninterrupted run drew.
    ``keep_live_position`` (a NaN rollback) leaves the data position and the NaN
    detector's counters as they are now, so the batches consumed since the checkpoint
    are not replayed and the rollback count survives.
    """
    if state.get("dataloader") and not keep_live_position:
        session.data.load_state_dict(state["dataloader"])
    if not keep_live_position:
        session.nan_detector.load_state_dict(state["nan_detector"])
    phases = state.get("extra", {}).get("phases")
    if phases:
        session.phases.load_state_dict(phases)
    restore_rng_state(state["rng"])
    return int(state["step"]), int(state["tokens_seen"])


def math_fingerprint(config: JobConfig) -> dict[str, Any]:
    """Config values whose change would alter the optimisation, for the resume guard."""
    model, train = config.model, config.train
    return {
        "model.dim": model.dim,
        "model.n_layers": model.n_layers,
        "model.n_heads": model.n_heads,
        "model.n_kv_heads": model.kv_heads,
        "model.vocab_size": model.vocab_size,
        "model.tie_embeddings": model.tie_embeddings,
        "model.hidden_dim": model.hidden_dim,
        "train.seq_len": train.seq_len,
        "train.batch_size": train.batch_size,
        "train.grad_accum_steps": train.grad_accum_steps,
    }


def check_resume_compatible(config: JobConfig, extra: dict[str, Any], path: str) -> None:
    """Refuse a resume whose config changes the math, unless the user allowed it.

    Harmless changes (max_steps, intervals, logging) are not in the fingerprint and pass.
    """
    saved = extra.get("math", {})
    current = math_fingerprint(config)
    changed = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v}
    if not changed:
        return
    if config.checkpoint.allow_config_change:
        for field, (old, new) in changed.items():
            logger.warning("resuming %s with %s changed from %r to %r", path, field, old, new)
        return
    field, (old, new) = next(iter(changed.items()))
    raise ConfigError(
        field,
        new,
        f"{old!r} as in the checkpoint {path}",
        "this change alters the training math; set checkpoint.allow_config_change=true to "
        "resume anyway, or checkpoint.resume_from='none' to start a new run",
    )


def apply_lr_scale(session: TrainingSession, scale: float) -> None:
    """Make the scheduler's base LRs initial_lr * scale and the current LRs follow.

    Written through the scheduler's own base_lrs so the scale is in its state_dict and a
    later resume reproduces it.
    """
    scheduler = session.scheduler
    groups = session.optimizer.param_groups
    scheduler.base_lrs = [group["initial_lr"] * scale for group in groups]
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in groups]


def roll_back(session: TrainingSession, path: str, step: int) -> tuple[int, int]:
    """Reload `path` after a NaN streak at `step`; keep the data position; return its step.

    Model, optimizer, scheduler and RNG come from the checkpoint. The data stays where it
    is, past every batch consumed since the checkpoint, so the bad batches are not replayed.
    The LR is scaled by train.nan_rollback_lr_scale (compounding over rollbacks).
    """
    tc = session.config.train
    session.checkpointer.wait()
    state = session.checkpointer.load(
        path, model=session.model, optimizer=session.optimizer, scheduler=session.scheduler
    )
    set_optimizer_mode(session.optimizer, True)  # checkpoints hold a schedule-free eval point
    new_step, tokens_seen = restore_train_state(session, state, keep_live_position=True)
    session.nan_detector.record_rollback(tc.nan_rollback_lr_scale)
    if session.nan_detector.lr_scale != 1.0:
        apply_lr_scale(session, session.nan_detector.lr_scale)
    logger.warning(
        "rolled back from step %d to %s (step %d) after %d non-finite steps in a row; the data "
        "position is kept, so the batches consumed since step %d (the bad ones included) are "
        "not replayed; LR scale now %g (rollback %d of %d)",
        step,
        path,
        new_step,
        tc.nan_consecutive_max,
        new_step,
        session.nan_detector.lr_scale,
        session.nan_detector.rollbacks,
        tc.nan_max_rollbacks,
    )
    return new_step, tokens_seen


def roll_back_or_stop(session: TrainingSession, step: int) -> tuple[int, int]:
    """After a NaN streak: reload the newest complete checkpoint, or raise NaNAbortError."""
    detector, tc = session.nan_detector, session.config.train
    bad_steps = detector.skipped_steps[-tc.nan_consecutive_max :]
    if detector.rollbacks >= tc.nan_max_rollbacks:
        raise NaNAbortError(bad_steps, detector.rollbacks, "train.nan_max_rollbacks used up")
    session.checkpointer.wait()  # a save in flight may be the newest good checkpoint
    path = session.checkpointer.newest_complete_path()
    if path is None:
        raise NaNAbortError(bad_steps, detector.rollbacks, "no checkpoint to roll back to")
    new_step, tokens_seen = roll_back(session, path, step)
    session.tracker.log_event(
        new_step,
        "nan_rollback",
        from_step=step,
        path=path,
        rollbacks=detector.rollbacks,
        lr_scale=detector.lr_scale,
    )
    return new_step, tokens_seen
