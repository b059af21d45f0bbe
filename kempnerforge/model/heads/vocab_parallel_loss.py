"""The fused head + cross-entropy in every layout: head_loss picks the single-rank chunked loss
(model/heads/head_loss.py) or, for a head split over the vocabulary (tensor parallelism), the
vocabulary-parallel one here: each rank computes only its vocabulary shard's logits, one
token chunk at a time, and the log-sum-exp and the target logit are reduced over the
tensor-parallel group."""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from kempnerforge.model.heads.head_loss import (
    IGNORE_INDEX,
    HeadLoss,
    HeadLossSpec,
    chunked_head_loss,
    linear_cross_entropy,
    logits_head_loss,
    softmax_losses,
)


def head_loss(
    hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor, spec: HeadLossSpec
) -> HeadLoss:
    """The loss of ``head`` on ``hidden`` against ``labels``, chunked over tokens: on one
    rank, or over the vocabulary shards when tensor parallelism split the head.

    Call it inside the model's forward: under FSDP the head's weight is whole (unsharded
    over the data-parallel ranks) only there. A DTensor weight split some other way falls
    back to the head's own output (whole logits), as a plain head and loss would compute.
    """
    weight = head.weight
    if is_vocab_sharded(weight):
        return vocab_parallel_head_loss(
            hidden,
            cast(DTensor, weight),
            labels,
            chunk_tokens=spec.chunk_tokens,
            z_loss_weight=spec.z_loss_weight,
        )
    if isinstance(weight, DTensor):
        return logits_head_loss(head(hidden), labels, spec.z_loss_weight)
    return linear_cross_entropy(
        hidden, weight, labels, chunk_tokens=spec.chunk_tokens, z_loss_weight=spec.z_loss_weight
    )


def is_vocab_sharded(weight: torch.Tensor) -> bool:
    """Whether ``weight`` (vocab, dim) is a DTensor split by vocabulary rows over a 1-D mesh,
    as tensor parallelism leaves the head's weight (FSDP, if any, has gathered its own axis
    inside the forward)."""
    return (
        isinstance(weight, DTensor)
        and weight.device_mesh.ndim == 1
        and tuple(weight.placements) == (Shard(0),)
    )


def shard_rows(num_rows: int, num_shards: int, index: int) -> tuple[int, int]:
    """(first row, row count) of shard ``index`` when ``num_rows`` split as DTensor's Shard
    does: ceil(num_rows / num_shards) rows each, the last ones short or empty."""
    per_shard = -(-num_rows // num_shards)
    first = min(index * per_shard, num_rows)
    return first, min(per_shard, num_rows - first)


def vocab_parallel_head_loss(
    hidden: torch.Tensor,
    weight: DTensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    z_loss_weight: float,
) -> HeadLoss:
    """Cross-entropy (plus z-loss) of ``hidden @ weight.T`` against ``labels`` without whole
    logits on any rank.

    ``weight`` is the head's weight split by vocabulary rows over the tensor-parallel mesh
    (is_vocab_sharded). ``hidden`` is the final norm's output: a DTensor split along the
    sequence (sequence parallelism), gathered here as the head's own input would be, or a
    plain tensor replicated on every rank (plain tensor parallelism). The tokens are
    walked in chunks of ``chunk_tokens`` (0 or less: one chunk); per chunk each rank holds
    (chunk, vocab / tp) logits and takes two all-reduces over the group, of 1 and 2 floats
    per token. Every rank returns the same loss and per-token losses; the gradient of its
    weight shard stays local, and that of ``hidden`` is a partial sum that autograd reduces
    over the group (reduce-scatter back onto the sequence shard, or all-reduce).
    Collective over the tensor-parallel group: every rank must call it with the same
    chunking.
    """
    mesh = weight.device_mesh
    whole_hidden = _replicated_local(hidden, mesh)
    local_weight = weight.to_local()
    first, count = shard_rows(weight.shape[0], mesh.size(), mesh.get_local_rank())
    assert local_weight.shape[0] == count, "the head's vocabulary shard is not DTensor's split"
    shard = _Shard(mesh.get_group(), first, z_loss_weight)
    chunk_loss = functools.partial(_chunk_loss, shard=shard)
    return chunked_head_loss(whole_hidden, local_weight, labels, chunk_tokens, chunk_loss)


def _replicated_local(hidden: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``hidden`` whole on this rank, as a plain tensor whose gradient is taken as a partial
    sum over ``mesh``: autograd reduces it to the input's own layout."""
    if not isinstance(hidden, DTensor):
        hidden = DTensor.from_local(hidden, mesh, [Replicate()], run_check=False)
    return hidden.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])


class _Shard:
    """What a rank's chunks need besides tensors: the group, its vocabulary offset and the
    z-loss weight."""

    def __init__(self, group: Any, first: int, z_loss_weight: float) -> None:
        self.group = group
        self.first = first
        self.z_loss_weight = z_loss_weight


def _chunk_loss(
    logits: torch.Tensor, targets: torch.Tensor, with_grad: bool, *, shard: _Shard
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token losses of one chunk from this rank's logits (chunk, vocab shard), and
    d(their sum)/d(these logits).

    The peak is all-reduced (max) first, then the shard's sum of exponentials and its
    target logit (zero unless the target is in this shard) are all-reduced (sum) together;
    every rank then holds the whole row's log-sum-exp. The gradient is the shard's slice of
    softmax * (1 + 2 * z * logsumexp) minus the one-hot target, zero on ignored rows.
    """
    logits = logits.float()
    supervised = targets != IGNORE_INDEX
    local = targets - shard.first
    owned = supervised & (local >= 0) & (local < logits.shape[1])
    safe = torch.where(owned, local, 0).unsqueeze(1)
    if logits.shape[1]:
        target_logits = torch.where(owned, logits.gather(1, safe).squeeze(1), 0.0)
        peak = logits.amax(dim=1)
    else:  # an empty shard (tp does not divide a small vocabulary)
        target_logits = torch.zeros(logits.shape[0], device=logits.device)
        peak = torch.full_like(target_logits, -torch.inf)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=shard.group)
    peak = torch.where(peak.isinf(), 0.0, peak)  # as torch.logsumexp: no inf - inf
    exp = logits.sub_(peak.unsqueeze(1)).exp_()
    sums = torch.stack([exp.sum(dim=1), target_logits])
    dist.all_reduce(sums, group=shard.group)
    total, target_logits = sums[0], sums[1]
    return softmax_losses(
        exp, peak, total, target_logits, supervised, (safe, owned), shard.z_loss_weight, with_grad
    )
