"""Checkpoints: atomic DCP saves (sync or async), the `latest` pointer, retention, resume, RNG.

The names below load on first use, so ``import kempnerforge.core.errors`` (what the
CLI needs at startup) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state
    from kempnerforge.core.errors import CheckpointError

_HOMES = {
    "CheckpointError": "kempnerforge.core.errors",
    "CheckpointManager": "kempnerforge.checkpoint.manager",
    "capture_rng_state": "kempnerforge.checkpoint.rng",
    "restore_rng_state": "kempnerforge.checkpoint.rng",
}

__all__ = ["CheckpointError", "CheckpointManager", "capture_rng_state", "restore_rng_state"]


def __getattr__(name: str) -> Any:
    """Import the module that defines `name` the first time someone asks for it."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
