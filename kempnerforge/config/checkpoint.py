"""[checkpoint]: when and where the run saves itself, and what it resumes from."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import check_at_least, check_choice
from kempnerforge.config.errors import ConfigError

ASYNC_MODES = ("disabled", "async")


@dataclass
class CheckpointConfig:
    interval: int = 100
    """Save every N optimizer steps; 0 saves only at the end of the run."""
    dir: str = ""
    """Checkpoint directory; empty means <train.run_dir>/checkpoints."""
    resume_from: str = "auto"
    """'auto' (the newest complete checkpoint in dir; broken ones are skipped with a warning),
    'none', or a checkpoint path (absolute, or a name such as step_30 inside dir)."""
    load_weights_only: bool = False
    """Start a new run from the resumed checkpoint's model weights only: fresh optimizer,
    scheduler and data position, step 0."""
    allow_config_change: bool = False
    """Resume even when a field that changes the math (model shape, vocab, seq_len, batch,
    grad accumulation) differs from the checkpoint's; the change is logged."""
    async_mode: str = "disabled"
    """'disabled' (the loop waits for each save) or 'async' (the write happens in the
    background while training goes on; at most one save is in flight)."""
    keep_last_n: int = 0
    """Keep only the newest N checkpoints; 0 keeps all. The one 'latest' names is never deleted."""
    keep_every: int = 0
    """Also keep every checkpoint whose step is a multiple of this, whatever keep_last_n says;
    0 marks none."""

    def __post_init__(self) -> None:
        check_at_least("checkpoint.interval", self.interval, 0)
        check_at_least("checkpoint.keep_last_n", self.keep_last_n, 0)
        check_at_least("checkpoint.keep_every", self.keep_every, 0)
        check_choice("checkpoint.async_mode", self.async_mode, ASYNC_MODES)
        if not self.resume_from:
            raise ConfigError(
                "checkpoint.resume_from", self.resume_from, "'auto', 'none' or a checkpoint path"
            )
