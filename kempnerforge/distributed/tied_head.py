"""A tied embedding and head split over pipeline stages: one weight, two copies.

With model.tie_embeddings the embedding (stage 0, pipeline rank 0) and the output head (the
last stage, pipeline rank pp - 1) are one weight, but the stages live on different ranks.
Each of the two ranks holds its own copy, drawn with the same values (the head's copy is
seeded under the embedding's name: Transformer.init_parameters) and classified as an
embedding by the optimizer; after every backward the two ranks add each other's gradient
(sum_tied_gradients), which is the whole model's gradient of the tied weight. Same values,
same gradient, same optimizer settings: the copies take the same step and stay equal
bitwise. The gradient norm counts the weight once (total_grad_norm leaves the head's copy
out), and a checkpoint holds its optimizer state once, under the embedding's name
(checkpoint/tied_head.py), as the whole model's does, so a run resumes on any layout.

The exchange is one send and one receive between the two ranks, over the pipeline group
that already connects them: no group of its own, and nothing for the stages in between.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kempnerforge.model.contract import FamilyModel


def tied_weight(model: nn.Module) -> torch.Tensor | None:
    """This rank's copy of a tied weight whose other copy is on another pipeline rank: the
    embedding's or the head's weight; None on a rank holding neither or both."""
    if not isinstance(model, FamilyModel):
        return None
    if model.embedding_copied:
        return model.get_parameter("tok_embeddings.weight")
    if model.tied_head_copy:
        return model.get_parameter("output.weight")
    return None


def tied_head_copy(model: nn.Module) -> bool:
    """Whether ``model`` holds the head's copy of a tied weight (the embedding is elsewhere)."""
    return isinstance(model, FamilyModel) and model.tied_head_copy


@torch.no_grad()
def sum_tied_gradients(model: nn.Module, group: dist.ProcessGroup, pp_size: int) -> None:
    """Add the other copy's gradient to this rank's copy of a tied weight (both ranks end
    with the same sum: a + b and b + a are the same floating-point number). Collective
    between pipeline ranks 0 and ``pp_size`` - 1 of ``group``; nothing on the others.

    Each side holds its copy sharded the same way (FSDP over the same data-parallel ranks,
    tensor parallelism splitting the vocabulary rows of both), so the local shards
    correspond and travel as they are.
    """
    weight = tied_weight(model)
    if weight is None:
        return
    peer = dist.get_global_rank(group, 0 if tied_head_copy(model) else pp_size - 1)
    grad = weight.grad
    if grad is None:
        raise RuntimeError("a tied embedding's copy has no gradient after the backward")
    if (
        isinstance(grad, DTensor)
        and isinstance(weight, DTensor)
        and grad.placements != weight.placements
    ):
        # The head's vocabulary-parallel loss may leave its gradient laid out otherwise
        # (whole on every rank); both copies exchange their weight's own shards.
        grad = grad.redistribute(weight.device_mesh, weight.placements)
        weight.grad = grad
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    theirs = torch.empty_like(local)
    ops = [
        dist.P2POp(dist.isend, local.contiguous(), peer, group),
        dist.P2POp(dist.irecv, theirs, peer, group),
    ]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    local.add_(theirs)
