"""After a streak of non-finite steps: roll back to the last checkpoint, or stop the run."""

from __future__ import annotations

from kempnerforge.core.logging import get_logger
from kempnerforge.optim.optimizer import set_optimizer_mode
from kempnerforge.resilience.nan import NaNAbortError, describe_attempts
from kempnerforge.training.lr import refresh_learning_rates
from kempnerforge.training.session import TrainingSession
from kempnerforge.training.state import restore_train_state

logger = get_logger(__name__)


def roll_back(session: TrainingSession, path: str, step: int) -> tuple[int, int]:
    """Reload `path` after a NaN streak at `step`; keep the data position; return its step.

    Model, optimizer, scheduler and RNG come from the checkpoint. The data stays where it
    is, past every batch consumed since the checkpoint, so the bad batches are not replayed.
    The LR is scaled by train.nan_rollback_lr_scale (compounding over rollbacks), on top of
    the schedule and the phase in force.
    """
    tc, detector = session.config.train, session.nan_detector
    streak = describe_attempts(detector.streak)
    detector.record_rollback(tc.nan_rollback_lr_scale)  # the streak starts over
    session.checkpointer.wait()
    state = session.checkpointer.load(
        path, model=session.model, optimizer=session.optimizer, scheduler=session.scheduler
    )
    set_optimizer_mode(session.optimizer, True)  # checkpoints hold a schedule-free eval point
    new_step, tokens_seen = restore_train_state(session, state, keep_live_position=True)
    refresh_learning_rates(session)
    logger.warning(
        "rolled back from step %d to %s (step %d) after %d non-finite attempts in a row (%s); "
        "the data position is kept, so the batches consumed since step %d (the bad ones "
        "included) are not replayed; LR scale now %g (rollback %d of %d)",
        step,
        path,
        new_step,
        tc.nan_consecutive_max,
        streak,
        new_step,
        session.nan_detector.lr_scale,
        session.nan_detector.rollbacks,
        tc.nan_max_rollbacks,
    )
    return new_step, tokens_seen


def roll_back_or_stop(session: TrainingSession, step: int) -> tuple[int, int]:
    """After a NaN streak: reload the newest complete checkpoint, or raise NaNAbortError."""
    detector, tc = session.nan_detector, session.config.train
    if detector.rollbacks >= tc.nan_max_rollbacks:
        raise NaNAbortError(detector.streak, detector.rollbacks, "train.nan_max_rollbacks used up")
    session.checkpointer.wait()  # a save in flight may be the newest good checkpoint
    path = session.checkpointer.newest_complete_path()
    if path is None:
        raise NaNAbortError(detector.streak, detector.rollbacks, "no checkpoint to roll back to")
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
