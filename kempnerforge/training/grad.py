"""Gradient helpers the step bodies share: clipping and skipping gradient sync."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel


def total_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Global L2 norm of all gradients (before clipping); clips in place when max_norm > 0.

    Returns a 0-d tensor on the gradients' device, so the caller decides when to sync.
    A sharded (DTensor) norm is materialised to a plain tensor.
    """
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return torch.zeros(())
    if max_norm > 0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=True)
    else:
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return norm


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
