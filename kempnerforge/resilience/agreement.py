"""Cross-rank agreement on per-rank decisions, such as stopping now.

A signal reaches ranks at different times, and a rank-local check can differ across
pipeline stages. A decision that changes which collectives run next (saving, skipping
the optimizer step) must be the same on every rank, or the ranks that disagree hang in
a collective the others never enter.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.resilience.shutdown import ShutdownHandler


def agree_on_stop(
    local_stop: bool, device: torch.device, group: dist.ProcessGroup | None = None
) -> bool:
    """True on every rank when any rank wants to stop; identity without torch.distributed.

    Collective: every rank of ``group`` (the default group when None) calls it at the same
    point, once per step boundary. It costs one all-reduce of a one-element tensor and one
    host sync. ``device`` is where the tensor lives: CPU for gloo, this rank's CUDA device
    for nccl.
    """
    return any_rank([local_stop], device, group)[0]


def agreed_stop(handler: ShutdownHandler, runtime: RuntimeContext) -> bool:
    """Whether to stop now, agreed by every rank from their handlers' requests.

    A stop vote every rank took together since the last call (a training step's, kept by
    ShutdownHandler.record_vote) is that agreement: no collective is held for it. Without
    one, collective when distributed (agree_on_stop); a stop another rank asked for becomes
    this handler's request too, so the shutdown is logged and exits the same everywhere.
    One process has no one to agree with: it acts on its own request at once.
    """
    vote = handler.take_vote()
    if not runtime.is_distributed:
        return handler.requested
    if vote is not None:
        return vote
    stop = agree_on_stop(handler.requested, runtime.device)
    if stop and not handler.requested:
        handler.request("another rank received a stop signal")
    return stop


def any_rank(
    flags: Sequence[bool], device: torch.device, group: dist.ProcessGroup | None = None
) -> tuple[bool, ...]:
    """For each flag, True when it is True on any rank: one all-reduce (MAX) for all of them.

    Lets a caller fold several decisions (a bad step and a stop) into a single collective;
    the same contract as `agree_on_stop`. Without an initialized process group it returns
    the flags unchanged.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return tuple(bool(f) for f in flags)
    if device.type == "cpu" and dist.get_backend(group) == "nccl":
        raise ValueError("an nccl process group needs a CUDA device for the agreement tensor")
    votes = torch.tensor([1 if f else 0 for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=group)
    return tuple(bool(v) for v in votes.tolist())
