"""Gradient helpers the step bodies share: clipping and skipping gradient sync."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from kempnerforge.distributed.tied_head import tied_head_copy
from kempnerforge.model.contract import FamilyModel


def total_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (before clipping); clips in place when max_norm > 0.

    Global over every mesh: a sharded (DTensor) gradient's norm covers all its shards, and
    a pipeline stage's squared norm is summed with the other stages' (see
    FamilyModel.pipeline_group), so every rank sees, and clips with, the same number; a NaN on
    any stage is a NaN everywhere. Returns a 0-d fp32 tensor on the gradients' device
    without reading it to the host.
    """
    params: list[torch.Tensor] = [p for p in model.parameters() if p.grad is not None]
    group = model.pipeline_group if isinstance(model, FamilyModel) else None
    squares = torch.zeros((), dtype=torch.float32, device=_model_device(model))
    by_mesh = _params_by_mesh(params)
    # A tied weight split over two stages is counted once: its embedding's copy.
    head_copy = model.get_parameter("output.weight") if tied_head_copy(model) else None
    for same_mesh in _params_by_mesh([p for p in params if p is not head_copy]):
        grads = [p.grad for p in same_mesh if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares = squares + norm.float().square()
    if group is not None:
        dist.all_reduce(squares, group=group)
    total = squares.sqrt()
    if max_norm > 0:
        for same_mesh in by_mesh:
            torch.nn.utils.clip_grads_with_norm_(same_mesh, max_norm, total, foreach=True)
    return total


def _model_device(model: torch.nn.Module) -> torch.device:
    for tensor in model.parameters():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.device
    return torch.device("cpu")


def _params_by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Parameters grouped so each norm and clip call sees one kind of gradient: plain
    tensors, or DTensors of one mesh (tensor parallelism leaves a head it cannot split
    plain beside sharded ones, and one foreach call cannot mix them)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for param in params:
        grad = param.grad
        key = id(grad.device_mesh) if isinstance(grad, DTensor) else 0
        groups.setdefault(key, []).append(param)
    return list(groups.values())


@contextlib.contextmanager
def maybe_no_sync(model: torch.nn.Module, micro: int, num_micro: int) -> Iterator[None]:
    """Skip the data-parallel gradient reduction on all but the last micro-batch.

    Works for FSDP2 modules (set_requires_gradient_sync) and DDP (no_sync); does nothing for
    a plain module or a single micro-batch.
    """
    last = micro == num_micro - 1
    if last or num_micro == 1:
        yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    elif isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    else:
        yield
