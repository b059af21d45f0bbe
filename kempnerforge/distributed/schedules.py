"""The pipeline schedules distributed.pp_schedule names, and how many stages each runs.

torch.distributed.pipelining is imported when a schedule is built, not with this module:
it imports the compiler stack (about 0.6 s of CPU), which a run without pipelining never
needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SINGLE_STAGE = ("gpipe", "1f1b")
"""Schedules that run one stage per rank."""
MULTI_STAGE = ("interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")
"""Schedules that run several stages per rank (the V-shaped ones exactly two, placed by
stages_of_rank with v_shaped=True: torch's V schedules assume that placement)."""


def build_schedule(
    name: str,
    stages: list[Any],
    num_microbatches: int,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> Any:
    """The torch.distributed.pipelining schedule ``name`` (a distributed.pp_schedule value)
    over this rank's ``stages``, in stage order.

    Gradients are not scaled by the micro-batch count (``scale_grads=False``): ``loss``
    carries the step's normalisation.
    """
    if name in SINGLE_STAGE:
        if len(stages) != 1:
            raise ValueError(f"pp_schedule {name!r} runs one stage per rank, not {len(stages)}")
        return _schedule_class(name)(stages[0], num_microbatches, loss_fn=loss, scale_grads=False)
    if name not in MULTI_STAGE:
        raise ValueError(f"unknown pp_schedule {name!r}: one of {[*SINGLE_STAGE, *MULTI_STAGE]}")
    return _schedule_class(name)(stages, num_microbatches, loss_fn=loss, scale_grads=False)


def _schedule_class(name: str) -> Any:
    """torch's class of schedule ``name``."""
    from torch.distributed import pipelining

    return {
        "gpipe": pipelining.ScheduleGPipe,
        "1f1b": pipelining.Schedule1F1B,
        "interleaved_1f1b": pipelining.ScheduleInterleaved1F1B,
        "interleaved_zb": pipelining.ScheduleInterleavedZeroBubble,
        "zbv": pipelining.ScheduleZBVZeroBubble,
        "dualpipev": pipelining.ScheduleDualPipeV,
    }[name]
