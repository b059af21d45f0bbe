"""The train state a checkpoint carries beside model and optimizer, and putting it back."""

from __future__ import annotations

from typing import Any

from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.resilience.nan import NaNDetector
from kempnerforge.training.families import family_of
from kempnerforge.training.freeze import freeze_for_step
from kempnerforge.training.session import TrainingSession


def capture_train_state(
    data: DataPipeline,
    nan_detector: NaNDetector,
    step: int,
    tokens_seen: int,
    extra: dict[str, Any],
    stream: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything besides weights and optimizer that a resume needs to continue exactly:
    the data position, the RNG, the NaN detector's counters, ``extra`` (checkpoint_extra)
    and, when it has any, the batch stream's own state (``stream``: the rollout a GRPO rank
    is training on, training/objectives/rollouts.py)."""
    counters = nan_detector.state_dict()
    position = data.state_dict()
    state = {
        "step": step,
        "tokens_seen": tokens_seen,
        "dataloader": position,
        "rng": capture_rng_state(),
        "nan_detector": counters,
        "extra": extra,
    }
    if stream:
        state["batches"] = stream
    return state


def restore_train_state(
    session: TrainingSession, state: dict[str, Any], *, keep_live_position: bool = False
) -> tuple[int, int]:
    """Put a loaded train state back into the session; return (step, tokens_seen).

    The RNG is restored last, after everything that might draw random numbers while
    being rebuilt, so the next step draws exactly what the uninterrupted run drew.
    ``keep_live_position`` (a NaN rollback) leaves the data position and the NaN
    detector's counters as they are now, so the batches consumed since the checkpoint
    are not replayed and the rollback count survives; the loss-spike window is the
    checkpoint's, the losses of the weights it goes back to.
    """
    if state.get("dataloader") and not keep_live_position:
        session.data.load_state_dict(state["dataloader"])
        session.batches.load_state_dict(state.get("batches", {}))
    if not keep_live_position:
        session.nan_detector.load_state_dict(state["nan_detector"])
    else:
        # The weights go back to the checkpoint's: so do the losses spikes are judged by.
        session.nan_detector.load_spike_window(state["nan_detector"])
    phases = state.get("extra", {}).get("phases")
    if phases:
        session.phases.load_state_dict(phases)
    step = int(state["step"])
    # The freeze state is the config's at this step, whatever the model held before; the
    # loaded optimizer state already matches it (a frozen parameter has none saved).
    config = session.config
    freeze_for_step(session.model, family_of(config).freeze_schedule(config), step)
    session.phases.skip_freeze_to(step)
    restore_rng_state(state["rng"])
    return step, int(state["tokens_seen"])
