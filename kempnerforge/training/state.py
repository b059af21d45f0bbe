"""The train state a checkpoint carries beside model and optimizer, and putting it back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig
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
