"""Lion: the sign of an interpolated momentum as the update, with decoupled weight decay."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms").

    Per step, with gradient g and momentum m:
        update = sign(beta1 * m + (1 - beta1) * g)
        p      = p * (1 - lr * weight_decay) - lr * update
        m      = beta2 * m + (1 - beta2) * g
    Every coordinate moves by exactly lr, so Lion wants a smaller lr than AdamW.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                m, g = state["exp_avg"], p.grad
                update = torch.lerp(g, m, beta1).sign_()  # beta1 * m + (1 - beta1) * g
                if wd != 0:
                    p.mul_(1 - lr * wd)
                p.add_(update, alpha=-lr)
                m.lerp_(g, 1 - beta2)  # beta2 * m + (1 - beta2) * g
        return loss
