"""Checkpoints: atomic DCP saves (sync or async), the `latest` pointer, retention, resume, RNG."""

from kempnerforge.checkpoint.manager import CheckpointError, CheckpointManager
from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state

__all__ = ["CheckpointError", "CheckpointManager", "capture_rng_state", "restore_rng_state"]
