"""Lion: the sign of an interpolated momentum as the update, with decoupled weight decay."""

# torch._foreach_* are the multi-tensor ops torch's own optimizers run on, but torch's
# type stubs do not export underscored names.
# pyright: reportPrivateImportUsage=false

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kempnerforge.optim.foreach_optimizer import ForeachOptimizer
from kempnerforge.optim.multi_tensor import bucket, foreach_or_loop, use_foreach, with_grad


class Lion(ForeachOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    Per step, with gradient g and momentum m:
        update = sign(beta1 * m + (1 - beta1) * g)
        p      = p * (1 - lr * weight_decay) - lr * update
        m      = beta2 * m + (1 - beta2) * g
    Every coordinate moves by exactly lr, so Lion wants a smaller lr than AdamW.

    ``foreach``: True runs each operation as one foreach call over a group's parameters
    (per device, dtype and mesh), False loops over them, None picks per device (see
    use_foreach: the loop for CPU tensors, foreach on accelerators and for DTensors). Both
    run the same operations in the same order, with the same results; foreach holds the
    group's updates at once, the loop one parameter's.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        super().__init__(params, defaults, foreach)

    def _group_step(self, group: dict[str, Any]) -> None:
        params, grads = with_grad(group)
        moms = [state["exp_avg"] for state in self._states(params, _fresh_state)]
        for ps, gs, ms in bucket(params, grads, moms):
            _update(ps, gs, ms, group)


def _fresh_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter's state before its first step: the momentum m at zero."""
    return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    moms: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """One bucket's step, per parameter or as foreach calls (see use_foreach): the same
    operations in the same order either way."""
    lr, wd = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    if not use_foreach(group["foreach"], params):
        for p, g, m in zip(params, grads, moms, strict=True):
            update = torch.lerp(g, m, beta1).sign_()  # beta1 * m + (1 - beta1) * g
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.add_(update, alpha=-lr)
            m.lerp_(g, 1 - beta2)  # beta2 * m + (1 - beta2) * g
        return
    updates = foreach_or_loop("lerp", _lerp_each, grads, moms, beta1)
    foreach_or_loop("sign_", _sign_each, updates)
    if wd != 0:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_add_(params, updates, alpha=-lr)
    torch._foreach_lerp_(moms, grads, 1 - beta2)


def _lerp_each(starts: list[torch.Tensor], ends: list[torch.Tensor], weight: float) -> list:
    return [torch.lerp(s, e, weight) for s, e in zip(starts, ends, strict=True)]


def _sign_each(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        t.sign_()
