"""[checkpoint]: when and where the run saves itself, and what it resumes from."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import check_at_least
from kempnerforge.config.errors import ConfigError


@dataclass
class CheckpointConfig:
    interval: int = 100
    """Save every N optimizer steps; 0 saves only at the end of the run."""
    dir: str = ""
    """Checkpoint directory; empty means <train.run_dir>/checkpoints."""
    resume_from: str = "auto"
    """'auto' (the newest complete checkpoint in dir, if any), 'none', or a step_<N> path."""
    keep_last_n: int = 0
    """Keep only the newest N checkpoints; 0 keeps all. The one 'latest' names is never deleted."""

    def __post_init__(self) -> None:
        check_at_least("checkpoint.interval", self.interval, 0)
        check_at_least("checkpoint.keep_last_n", self.keep_last_n, 0)
        if not self.resume_from:
            raise ConfigError(
                "checkpoint.resume_from", self.resume_from, "'auto', 'none' or a checkpoint path"
            )
