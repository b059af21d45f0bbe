"""The pipeline schedules distributed.pp_schedule names, and how many stages each runs.

torch.distributed.pipelining is imported when a schedule is built, not with this module:
it imports the compiler stack (about 0.6 s of CPU), which a run without pipelining never
needs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

SINGLE_STAGE: dict[str, str] = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
"""Schedules that run one stage per rank, by the name of their torch class."""
MULTI_STAGE: dict[str, str] = {
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
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
    import torch.distributed.pipelining as pipelining

    if name in SINGLE_STAGE:
        if len(stages) != 1:
            raise ValueError(f"pp_schedule {name!r} runs one stage per rank, not {len(stages)}")
        schedule = getattr(pipelining, SINGLE_STAGE[name])
        return schedule(stages[0], num_microbatches, loss_fn=loss, scale_grads=False)
    if name not in MULTI_STAGE:
        raise ValueError(f"unknown pp_schedule {name!r}: one of {[*SINGLE_STAGE, *MULTI_STAGE]}")
    schedule = getattr(pipelining, MULTI_STAGE[name])
    return schedule(stages, num_microbatches, loss_fn=loss, scale_grads=False)
