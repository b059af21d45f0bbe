"""Optional torch.profiler traces on the [profiling] schedule of optimizer steps."""

from __future__ import annotations

import os
from typing import Any

import torch

from kempnerforge.config.profiling import ProfilingConfig


def build_profiler(
    cfg: ProfilingConfig, run_dir: str, first_step: int, rank: int = 0
) -> Any | None:
    """A torch.profiler following cfg's cycles, or None when disabled or nothing is left.

    The loop calls profiler.step() after each optimizer step, counting from first_step
    (the step the loop starts at). The schedule is anchored on absolute steps: a resumed
    run skips the cycles already begun before it and starts profiling at the next cycle
    boundary, so its cycles cover the same steps as they would have without the
    interruption (a cycle cut by the stop keeps the trace of what it recorded). Each rank
    writes its own traces, named by rank. profiler.step() runs after the tracker's timed
    region, so the logged step times do not include exporting a trace.
    """
    if not cfg.enable:
        return None
    # Optimizer step s is the (s - first_step)-th profiler step of this launch.
    skip = cfg.start_step - 1 - first_step  # steps of this launch before the first cycle
    repeat = cfg.repeat
    if skip < 0:
        done_cycles, into = divmod(-skip, cfg.cycle)
        if cfg.repeat and done_cycles >= cfg.repeat:
            return None
        repeat = cfg.repeat - done_cycles if cfg.repeat else 0
        # Join the cycle in progress: wait out its remainder instead of restarting it.
        skip = cfg.cycle - into if into else 0
        if into:
            repeat = repeat - 1 if repeat else 0
            if cfg.repeat and repeat == 0:
                return None
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    trace_dir = cfg.trace_dir or os.path.join(run_dir, "profiler")
    return torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(
            skip_first=skip,
            wait=cfg.wait,
            warmup=cfg.warmup,
            active=cfg.active,
            repeat=repeat,
        ),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(
            trace_dir, worker_name=f"rank{rank}"
        ),
        record_shapes=True,
        with_flops=True,
    )
