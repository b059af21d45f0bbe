"""[profiling]: optional torch.profiler traces on a schedule of optimizer steps."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import MAX_STEPS, check_at_least


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Record torch.profiler traces of the steps the schedule below marks active."""
    start_step: int = 5
    """The step (1-based optimizer step) the first cycle starts at; 1 to 2**62 - 1."""
    wait: int = 0
    """Steps at the start of each cycle that are not profiled."""
    warmup: int = 1
    """Steps after the wait that are profiled and thrown away (the profiler's own start-up
    cost lands there, not in the trace)."""
    active: int = 3
    """Steps after the warmup that are recorded: one trace per cycle and rank."""
    repeat: int = 1
    """Cycles of wait + warmup + active steps, back to back; 0 repeats until the run ends."""
    trace_dir: str = ""
    """Where traces go (one file per rank and cycle, named by rank); empty means
    <train.run_dir>/profiler. Open them with TensorBoard's profiler plugin or Perfetto."""

    def __post_init__(self) -> None:
        check_at_least("profiling.start_step", self.start_step, 1, MAX_STEPS)
        check_at_least("profiling.wait", self.wait, 0, MAX_STEPS)
        check_at_least("profiling.warmup", self.warmup, 0, MAX_STEPS)
        check_at_least("profiling.active", self.active, 1, MAX_STEPS)
        check_at_least("profiling.repeat", self.repeat, 0, MAX_STEPS)

    @property
    def cycle(self) -> int:
        """Steps per cycle."""
        return self.wait + self.warmup + self.active
