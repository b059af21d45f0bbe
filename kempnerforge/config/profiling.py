"""[profiling]: an optional torch.profiler trace over a window of steps."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import check_at_least
from kempnerforge.config.errors import ConfigError


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Record a torch.profiler trace of steps start_step..end_step."""
    start_step: int = 5
    """First profiled step (1-based optimizer step)."""
    end_step: int = 8
    """Last profiled step."""
    trace_dir: str = ""
    """Where traces go; empty means <train.run_dir>/profiler."""

    def __post_init__(self) -> None:
        check_at_least("profiling.start_step", self.start_step, 1)
        if self.end_step < self.start_step:
            raise ConfigError(
                "profiling.end_step", self.end_step, f">= profiling.start_step = {self.start_step}"
            )
