"""The train state a checkpoint carries beside model and optimizer, and putting it back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from kempnerforge.training.loop import TrainingSession


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


def restore_train_state(session: TrainingSession, state: dict[str, Any]) -> tuple[int, int]:
    """Put a loaded train state back into the session; return (step, tokens_seen).

    The RNG is restored last, after everything that might draw random numbers while
    being rebuilt, so the next step draws exactly what the uninterrupted run drew.
    """
    if state.get("dataloader"):
        session.data.load_state_dict(state["dataloader"])
    session.nan_detector.load_state_dict(state["nan_detector"])
    phases = state.get("extra", {}).get("phases")
    if phases:
        session.phases.load_state_dict(phases)
    restore_rng_state(state["rng"])
    return int(state["step"]), int(state["tokens_seen"])
