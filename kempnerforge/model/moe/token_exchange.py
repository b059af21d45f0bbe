"""Expert parallelism: send each token copy to the rank that owns its expert, and back.

The E experts of a Mixture-of-Experts layer are split contiguously over the ``ep`` ranks
of a process group: rank r owns global experts [r * E / ep, (r + 1) * E / ep). Both
directions are differentiable, so the backward pass runs the mirrored exchange.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

# The functional all-to-all is the one that carries autograd through uneven splits (also on
# gloo); the list form dist.all_to_all rejects uneven sizes on gloo.
from torch.distributed._functional_collectives import (
    AsyncCollectiveTensor,
    all_to_all_single_autograd,
)


@dataclass
class DispatchPlan:
    """What combine_tokens needs to send a dispatch's outputs back where they came from.

    ``send_splits[p]`` rows went from this rank to rank p and ``recv_splits[p]`` rows came
    from rank p. ``local_position[i]`` is where the i-th received row (in arrival order:
    by source rank, then local expert) sits in the local-expert-major order handed to the
    experts. ``group`` is None when nothing was exchanged (one expert-parallel rank).
    """

    send_splits: list[int]
    recv_splits: list[int]
    local_position: torch.Tensor | None
    group: ProcessGroup | None


def dispatch_tokens(
    rows: torch.Tensor, counts: torch.Tensor, group: ProcessGroup | None
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send every row to the rank that owns its expert; return the rows this rank must run.

    ``rows`` (N, D) are token copies sorted by global expert id and ``counts`` (E,) int64,
    on ``rows``' device, says how many rows each expert gets; rows past their sum (dropped
    by a capacity limit) are not sent. The result is
    ``(local_rows, local_counts, plan)``: ``local_rows`` (M, D) sorted by local expert (for
    local expert 0, the rows from source rank 0, then from rank 1, ...; then local expert 1),
    ``local_counts`` (E / ep,) rows per local expert, and the plan for combine_tokens.

    A collective over ``group``: every rank of it must call this with the same E. The split
    sizes are read to the host once (all-to-all needs them as Python ints), this function's
    one host sync. Counts that sum to more than N raise ValueError only after the counts were
    exchanged, so peers with correct counts wait in the next collective until it times out.
    With ``group`` None or of size 1 nothing is exchanged: ``rows`` and ``counts`` come back
    unchanged.
    """
    ep = 1 if group is None else dist.get_world_size(group)
    num_experts = counts.numel()
    if num_experts % ep != 0:
        raise ValueError(
            f"{num_experts} experts do not split evenly over {ep} expert-parallel ranks"
        )
    if group is None or ep == 1:
        n = rows.shape[0]
        return rows, counts, DispatchPlan([n], [n], None, None)
    num_local = num_experts // ep
    send_counts = counts.to(torch.int64).contiguous()
    # recv_counts[s * num_local + e]: rows rank s sends for this rank's local expert e.
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    per_peer = torch.stack(
        [send_counts.view(ep, num_local).sum(1), recv_counts.view(ep, num_local).sum(1)]
    )
    send_splits, recv_splits = per_peer.tolist()
    if sum(send_splits) > rows.shape[0]:
        raise ValueError(f"counts sum to {sum(send_splits)} rows but rows has {rows.shape[0]}")
    sent = rows[: sum(send_splits)]
    received = _exchange(sent.contiguous(), recv_splits, send_splits, group)
    local_position = _local_positions(recv_counts.view(ep, num_local), sum(recv_splits))
    # order[j]: the received row that goes to local position j (the inverse permutation).
    order = torch.empty_like(local_position)
    order[local_position] = torch.arange(local_position.numel(), device=order.device)
    local_rows = received.index_select(0, order)
    local_counts = recv_counts.view(ep, num_local).sum(0)
    return local_rows, local_counts, DispatchPlan(send_splits, recv_splits, local_position, group)


def combine_tokens(outputs: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
    """Send the experts' outputs back; return them on the source rank in ``rows``' order.

    ``outputs`` (M, D') are in the order of dispatch_tokens' ``local_rows``; D' may differ
    from D. A collective over the plan's group, like the dispatch that made the plan.
    """
    if plan.group is None or plan.local_position is None:
        return outputs
    if outputs.shape[0] != sum(plan.recv_splits):
        raise ValueError(
            f"outputs has {outputs.shape[0]} rows but the dispatch delivered "
            f"{sum(plan.recv_splits)}"
        )
    arrival_order = outputs.index_select(0, plan.local_position)
    return _exchange(arrival_order, plan.send_splits, plan.recv_splits, plan.group)


def _exchange(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: ProcessGroup
) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows; a plain tensor, already waited on."""
    y = all_to_all_single_autograd(x, out_splits, in_splits, group)
    # The functional collective returns a wrapper that waits on first use; wait here so the
    # caller gets a plain tensor and the communication ends inside this module.
    return y.wait() if isinstance(y, AsyncCollectiveTensor) else y


def _local_positions(recv_counts: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each received row, its index in local-expert-major order.

    ``recv_counts[s, e]`` rows arrive from source s for local expert e, grouped by s then e;
    the experts want them grouped by e then s. Each (s, e) block moves as a whole, so a
    row's new index is its old one shifted by its block's start in the new order minus its
    start in the old order: no sort and no loop over tokens.
    """
    arrival_start = _exclusive_cumsum(recv_counts.flatten())
    expert_major_start = _exclusive_cumsum(recv_counts.t().flatten()).view(
        recv_counts.shape[1], recv_counts.shape[0]
    )
    shift = expert_major_start.t().flatten() - arrival_start
    # output_size keeps repeat_interleave from reading its length back to the host.
    per_row_shift = torch.repeat_interleave(shift, recv_counts.flatten(), output_size=num_rows)
    return per_row_shift + torch.arange(num_rows, device=recv_counts.device)


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x
