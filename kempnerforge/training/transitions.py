"""Applying the step-keyed schedules to a running session: [[train.phases]] (mixture weights
and the LR scale) and a VLM's freeze stages."""

from __future__ import annotations

from kempnerforge.core.logging import get_logger
from kempnerforge.training.families import family_of
from kempnerforge.training.freeze import describe, freeze_for_step
from kempnerforge.training.lr import refresh_learning_rates
from kempnerforge.training.session import TrainingSession

logger = get_logger(__name__)


def advance_phases(session: TrainingSession, step: int) -> None:
    """Fire what is due at `step`: freeze stages, then phases (new mixture weights from the
    next batch, the LR scale)."""
    _advance_freeze(session, step)
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
    refresh_learning_rates(session)


def _advance_freeze(session: TrainingSession, step: int) -> None:
    """Put the model in the freeze state of `step` when a stage fires there.

    Runs right after optimizer step `step`, before its checkpoint, so step + 1 is the first
    trained with the new state and a checkpoint of `step` records it (vlm_freeze). A save
    still in flight is drained first: its optimizer state is the one before the change.
    """
    fired = session.phases.advance_freeze(step)
    if not fired:
        return
    session.checkpointer.wait()
    schedule = family_of(session.config).freeze_schedule(session.config)
    changes = freeze_for_step(session.model, schedule, step, session.optimizer)
    for stage in fired:
        logger.info("freeze stage of step %d: %s", stage.start_step, describe(changes))
        session.tracker.log_event(
            step,
            "freeze",
            start_step=stage.start_step,
            frozen=sorted(k[1:] for k in changes if k.startswith("-")),
            unfrozen=sorted(k for k in changes if not k.startswith("-")),
        )
