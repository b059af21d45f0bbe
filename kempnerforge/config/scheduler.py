"""[scheduler]: how the learning rate moves over the run."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import MAX_STEPS, check_at_least, check_choice, check_in_range

WSD_DECAY_TYPES = ("linear", "cosine", "sqrt")


@dataclass
class SchedulerConfig:
    name: str = "cosine"
    """Schedule after warmup, by registered name: 'cosine', 'linear', 'wsd', 'rex',
    'constant', or 'none' (factor 1 from step 0: no warmup either)."""
    warmup_steps: int = 100
    """Optimizer steps of linear warmup to the peak learning rate (the first step uses
    1 / warmup_steps of it); 0 to 2**62 - 1. Longer than train.max_steps, it is cut to
    train.max_steps with a warning, so the peak comes at the last step. Ignored by 'none'."""
    min_lr_ratio: float = 0.1
    """Where the decay ends (cosine, linear, rex and the WSD decay), as a fraction of the peak
    learning rate: the factor at progress 1, i.e. after the last step. Step s uses progress
    (s - 1 - warmup) / (train.max_steps - warmup), so the last step trains just above it."""
    wsd_decay_fraction: float = 0.2
    """WSD only: fraction of the post-warmup steps spent decaying at the end of the run."""
    wsd_decay_type: str = "linear"
    """WSD only: shape of the final decay: 'linear', 'cosine' or 'sqrt' (1 - sqrt(progress))."""

    def __post_init__(self) -> None:
        check_at_least("scheduler.warmup_steps", self.warmup_steps, 0, MAX_STEPS)
        check_in_range("scheduler.min_lr_ratio", self.min_lr_ratio, 0.0, 1.0)
        check_in_range("scheduler.wsd_decay_fraction", self.wsd_decay_fraction, 0.0, 1.0)
        check_choice("scheduler.wsd_decay_type", self.wsd_decay_type, WSD_DECAY_TYPES)
