"""[metrics]: what the run reports and how often."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import MAX_STEPS, check_choice, check_positive

PROGRESS_MODES = ("auto", "bar", "plain", "off")


@dataclass
class MetricsConfig:
    log_interval: int = 10
    """Write a metrics.jsonl row and a console line every N optimizer steps (and on the first
    step); 1 to 2**62 - 1."""
    progress: str = "auto"
    """'auto' (a live bar on a terminal, plain lines otherwise), 'bar', 'plain' or 'off'."""

    def __post_init__(self) -> None:
        check_positive("metrics.log_interval", self.log_interval, MAX_STEPS)
        check_choice("metrics.progress", self.progress, PROGRESS_MODES)
