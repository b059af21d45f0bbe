"""What the foreach optimizers share: which parameters of a group get a step, how their
tensors split into lists one foreach call accepts, which path a list takes, and the list
ops DTensor lacks."""

# torch._foreach_* are the multi-tensor ops torch's own optimizers run on, but torch's
# type stubs do not export underscored names.
# pyright: reportPrivateImportUsage=false

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor

TensorLists = tuple[list[torch.Tensor], ...]


def use_foreach(foreach: bool | None, tensors: list[torch.Tensor]) -> bool:
    """Whether one bucket (see bucket()) takes the foreach path: ``foreach`` when set; for
    None (optimizer.implementation = 'auto') the faster path for where the tensors live.

    On the CPU a foreach op is a loop over the same per-tensor kernels, which holds every
    temporary at once instead of one; the per-parameter loop measured as fast or faster
    there (torch's own optimizers also default to it on the CPU). Accelerators
    launch one kernel per op and list, and DTensors pay one sharding dispatch per op and
    list: foreach, several times faster.
    """
    if foreach is not None:
        return foreach
    first = tensors[0]
    return isinstance(first, DTensor) or first.device.type != "cpu"


def with_grad(group: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The group's parameters that have a gradient this step, in group order, and their
    gradients; a parameter without one is left alone (no state, no decay)."""
    params: list[torch.Tensor] = []
    grads: list[torch.Tensor] = []
    for p in group["params"]:
        if p.grad is not None:
            params.append(p)
            grads.append(p.grad)
    return params, grads


def bucket(*lists: list[torch.Tensor]) -> list[TensorLists]:
    """Split parallel lists (params, grads, state, ...) into buckets of equal device, dtype
    and DTensor mesh, keeping the order within each bucket.

    One foreach call takes tensors of one device and dtype, and DTensors of one mesh; a
    plain tensor and a DTensor never share a call. Bucketed by the first list's tensors.
    """
    buckets: dict[tuple[Any, ...], TensorLists] = {}
    for i, t in enumerate(lists[0]):
        mesh = t.device_mesh if isinstance(t, DTensor) else None
        key = (t.device, t.dtype, id(mesh))
        if key not in buckets:
            buckets[key] = tuple([] for _ in lists)
        for out, src in zip(buckets[key], lists, strict=True):
            out.append(src[i])
    return list(buckets.values())


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """dst[i].copy_(src[i]) for every i, in one call where the tensors allow it.

    DTensor has no sharding rule for the foreach copy, so DTensor lists copy one by one
    (a copy has no temporary, so the loop costs only its dispatches).
    """
    if dst and not isinstance(dst[0], DTensor):
        torch._foreach_copy_(dst, src)
        return
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)


DTENSOR_LACKS: set[str] = set()
"""The foreach ops (names after ``_foreach_``) this torch's DTensor refused for want of a
sharding rule; later torch generates rules for every foreach op, torch 2.11 lists some."""


def foreach_or_loop(name: str, loop: Callable[..., Any], *args: Any) -> Any:
    """``torch._foreach_<name>(*args)``, or ``loop(*args)`` (the same op, one tensor at a
    time) for DTensor lists where this torch's DTensor has no sharding rule for it.

    DTensor checks for the rule before it computes anything, so a refused call changed no
    tensor; the refusal is remembered and the op takes the loop from then on.
    """
    dtensors = isinstance(args[0][0], DTensor)
    if dtensors and name in DTENSOR_LACKS:
        return loop(*args)
    try:
        return getattr(torch, f"_foreach_{name}")(*args)
    except NotImplementedError:
        if not dtensors:
            raise
        DTENSOR_LACKS.add(name)
        return loop(*args)
