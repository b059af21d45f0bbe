"""NaNDetector: tells the loop which steps to skip, and when too many in a row mean stop."""

from __future__ import annotations

import math
from typing import Any

from kempnerforge.metrics.logging import get_logger

logger = get_logger(__name__)

_KEPT_STEP_IDS = 100


class NaNAbortError(RuntimeError):
    """Too many consecutive non-finite steps: the run stops (the CLI exits with NAN_ABORT)."""

    def __init__(self, steps: list[int], rollbacks: int = 0, reason: str = "") -> None:
        self.steps = list(steps)
        self.rollbacks = rollbacks
        shown = ", ".join(str(s) for s in self.steps)
        after = f" after {rollbacks} rollback(s)" if rollbacks else ""
        why = f" ({reason})" if reason else ""
        super().__init__(
            f"{len(self.steps)} consecutive steps had a non-finite loss or gradient norm "
            f"(steps {shown}){after}{why}; lower the learning rate or resume from an "
            "earlier checkpoint"
        )


class NaNDetector:
    """Judges each step by its loss and gradient norm; counts the bad ones.

    A step is good only when both values are finite: a finite loss with an inf/NaN
    gradient norm would otherwise let the clip scale the gradients by NaN. The caller
    skips the optimizer step for a bad one and stops once `exhausted` is True.
    """

    def __init__(self, max_consecutive: int) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive must be >= 1, got {max_consecutive}")
        self.max_consecutive = max_consecutive
        self.consecutive = 0
        """Bad steps in a row, reset by a good step."""
        self.total_skipped = 0
        """Bad steps over the whole run, resumes included."""
        self.skipped_steps: list[int] = []
        """Ids of the most recent bad steps, oldest first (the last 100)."""
        self.rollbacks = 0
        """Rollbacks to a checkpoint after a streak of bad steps, over the whole run."""
        self.lr_scale = 1.0
        """Product of the LR scales applied by those rollbacks."""

    def check(self, loss: float, grad_norm: float, step: int) -> bool:
        """True when the step is good (loss and gradient norm both finite); logs a bad one."""
        bad = [
            name for name, value in (("loss", loss), ("grad_norm", grad_norm)) if not _finite(value)
        ]
        if not bad:
            self.consecutive = 0
            return True
        self.consecutive += 1
        self.total_skipped += 1
        self.skipped_steps = [*self.skipped_steps, step][-_KEPT_STEP_IDS:]
        logger.warning(
            "step %d: non-finite %s (loss=%s, grad_norm=%s); skipping the update (%d in a row, "
            "limit %d)",
            step,
            " and ".join(bad),
            loss,
            grad_norm,
            self.consecutive,
            self.max_consecutive,
        )
        return False

    @property
    def exhausted(self) -> bool:
        """True once `max_consecutive` bad steps have come in a row."""
        return self.consecutive >= self.max_consecutive

    def record_rollback(self, lr_scale: float) -> None:
        """A rollback happened: the streak starts over, the LR scale compounds."""
        self.consecutive = 0
        self.rollbacks += 1
        self.lr_scale *= lr_scale

    def state_dict(self) -> dict[str, Any]:
        return {
            "consecutive": self.consecutive,
            "total_skipped": self.total_skipped,
            "skipped_steps": list(self.skipped_steps),
            "rollbacks": self.rollbacks,
            "lr_scale": self.lr_scale,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = int(state["consecutive"])
        self.total_skipped = int(state["total_skipped"])
        self.skipped_steps = [int(s) for s in state["skipped_steps"]][-_KEPT_STEP_IDS:]
        self.rollbacks = int(state.get("rollbacks", 0))
        self.lr_scale = float(state.get("lr_scale", 1.0))


def _finite(value: float) -> bool:
    # float() also accepts 0-d tensors, so a caller holding a device scalar still works.
    return math.isfinite(float(value))
