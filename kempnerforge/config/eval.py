"""[eval]: periodic evaluation on held-out data."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import check_at_least, check_positive


@dataclass
class EvalConfig:
    interval: int = 0
    """Evaluate every N optimizer steps; 0 disables periodic eval."""
    steps: int = 10
    """Held-out batches per evaluation (the same batches every time)."""
    batch_size: int = 0
    """Sequences per eval batch; 0 means train.batch_size."""

    def __post_init__(self) -> None:
        check_at_least("eval.interval", self.interval, 0)
        check_positive("eval.steps", self.steps)
        check_at_least("eval.batch_size", self.batch_size, 0)

    @property
    def enabled(self) -> bool:
        return self.interval > 0
