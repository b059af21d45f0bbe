"""Identity functions whose backward changes the gradient: scaled by a constant, or summed
over a process group (a value every rank holds whole whose uses are split over the
ranks, so each rank's gradient is a partial sum)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def scaled_grad(tensor: torch.Tensor, scale: float) -> torch.Tensor:
    """``tensor`` as it is; in backward its gradient is multiplied by ``scale``."""
    return _ScaleGrad.apply(tensor, scale)


def summed_grad(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``tensor`` as it is; in backward its gradient is summed over ``group`` (one
    all-reduce of the tensor's size). None: no group, ``tensor`` itself."""
    if group is None:
        return tensor
    return _SumGrad.apply(tensor, group)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None
