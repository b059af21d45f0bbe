"""Applying [[train.phases]] to a running session: mixture weights and the LR scale."""

from __future__ import annotations

from kempnerforge.metrics.logging import get_logger
from kempnerforge.training.lr import refresh_learning_rates
from kempnerforge.training.session import TrainingSession

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
    refresh_learning_rates(session)
