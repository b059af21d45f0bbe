"""[profiling]: an optional torch.profiler trace over a window of steps."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import MAX_STEPS, check_at_least
from kempnerforge.config.errors import ConfigError


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Record a torch.profiler trace of steps start_step..end_step."""
    start_step: int = 5
    """First profiled step (1-based optimizer step); 1 to 2**62 - 1."""
    end_step: int = 8
    """Last profiled step (1-based optimizer step); start_step to 2**62 - 1."""
    trace_dir: str = ""
    """Where traces go; empty means <train.run_dir>/profiler."""

    def __post_init__(self) -> None:
        check_at_least("profiling.start_step", self.start_step, 1, MAX_STEPS)
        if self.end_step < self.start_step:
            raise ConfigError(
                "profiling.end_step", self.end_step, f">= profiling.start_step = {self.start_step}"
            )
        check_at_least("profiling.end_step", self.end_step, self.start_step, MAX_STEPS)
