"""An optional torch.profiler trace over a window of optimizer steps."""

from __future__ import annotations

import os
from typing import Any

import torch

from kempnerforge.config.profiling import ProfilingConfig


def build_profiler(cfg: ProfilingConfig, run_dir: str, first_step: int) -> Any | None:
    """A torch.profiler over optimizer steps start_step..end_step, or None.

    The loop calls profiler.step() after each optimizer step, counting from first_step
    (the step the loop starts at), so the window is shifted for a resumed run.
    """
    if not cfg.enable or cfg.end_step <= first_step:
        return None
    wait = max(cfg.start_step - 1 - first_step, 0)
    active = cfg.end_step - max(cfg.start_step - 1, first_step)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_dir = cfg.trace_dir or os.path.join(run_dir, "profiler")
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=wait, warmup=0, active=active, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(trace_dir),
        record_shapes=True,
        with_flops=True,
    )
