"""[metrics]: what the run reports and how often."""

from __future__ import annotations

from dataclasses import dataclass, field

from kempnerforge.config.checks import MAX_STEPS, check_choice, check_positive
from kempnerforge.core.errors import ConfigError

PROGRESS_MODES = ("auto", "bar", "plain", "off")
BACKENDS = ("tensorboard", "wandb")
WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Write a metrics.jsonl row and a console line every N optimizer steps (and on the first
    step); 1 to 2**62 - 1."""
    progress: str = "auto"
    """'auto' (a live bar on a terminal, plain lines otherwise), 'bar', 'plain' or 'off'."""
    backends: list[str] = field(default_factory=list)
    """Where the logged rows also go, besides metrics.jsonl and the console (always on):
    'tensorboard' (event files in <run_dir>/tensorboard; pip install
    'kempnerforge[tensorboard]') and 'wandb' (Weights & Biases; pip install
    'kempnerforge[wandb]'). Written by rank 0 only."""
    wandb_project: str = "kempnerforge"
    """The W&B project of the run (the run's name is train.name)."""
    wandb_entity: str = ""
    """The W&B entity (user or team); empty: the account's default."""
    wandb_mode: str = "offline"
    """'offline' (written under <run_dir>/wandb, no account or network needed; upload later
    with `wandb sync`), 'online' or 'disabled'."""

    def __post_init__(self) -> None:
        check_positive("metrics.log_interval", self.log_interval, MAX_STEPS)
        check_choice("metrics.progress", self.progress, PROGRESS_MODES)
        for i, backend in enumerate(self.backends):
            check_choice(f"metrics.backends[{i}]", backend, BACKENDS)
        if len(set(self.backends)) != len(self.backends):
            raise ConfigError(
                "metrics.backends", self.backends, "each backend at most once", "remove the repeat"
            )
        check_choice("metrics.wandb_mode", self.wandb_mode, WANDB_MODES)
