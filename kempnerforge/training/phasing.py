"""Applying [[train.phases]] to a running session: mixture weights and the LR scale."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kempnerforge.metrics.logging import get_logger

if TYPE_CHECKING:
    from kempnerforge.training.loop import TrainingSession

logger = get_logger(__name__)


def advance_phases(session: TrainingSession, step: int) -> None:
    """Fire the phases due at `step`: new mixture weights from the next batch, the LR scale."""
    fired = session.phases.advance(step)
    if not fired:
        return
    for phase in fired:
        if phase.dataset_weights:
            session.data.set_weights(phase.dataset_weights)
        logger.info(
            "phase from step %d: weights %s, lr scale %g",
            phase.start_step,
            phase.dataset_weights or "unchanged",
            phase.lr_scale,
        )
        session.tracker.log_event(
            step, "phase", start_step=phase.start_step, lr_scale=phase.lr_scale
        )
    session.batches.reset()  # the next batch is drawn under the new weights
    apply_phase_lr_scale(session)


def apply_phase_lr_scale(session: TrainingSession) -> None:
    """Set each group's LR to the scheduler's value times the phase's factor.

    Computed from the scheduler's last value, not the group's current LR, so applying it
    twice in one step (a phase firing right after the scheduler's step) never compounds.
    """
    if not session.phases.active:
        return
    for group, lr in zip(
        session.optimizer.param_groups, session.scheduler.get_last_lr(), strict=True
    ):
        group["lr"] = lr * session.phases.lr_scale
