"""Schedule-free AdamW: iterate averaging in place of a decaying LR schedule, with a
train/eval switch between the gradient point y and the averaged point x."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-free AdamW (Defazio et al. 2024, "The Road Less Scheduled").

    Keeps, per parameter, the base sequence z, the average x and Adam's second moment v;
    the parameter itself holds y = beta1 * x + (1 - beta1) * z, where gradients are taken.
    Step t (1-based), with lr_t = lr * min(1, t / warmup_steps) * sqrt(1 - beta2^t):
        v = beta2 * v + (1 - beta2) * g^2
        z = z - lr_t * (g / (sqrt(v) + eps) + weight_decay * y)
        c = lr_t^2 / sum_{i<=t} lr_i^2;   x = (1 - c) * x + c * z
        y = beta1 * x + (1 - beta1) * z
    Evaluate and checkpoint at x: ``eval()`` copies x into the parameters, ``train()``
    recomputes y from the stored x and z with the same expression, so the round trip is
    bitwise. The mode lives in each group's ``train_mode``, so a loaded optimizer knows
    whether the loaded parameters are x or y.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
    ) -> None:
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "warmup_steps": warmup_steps,
            "train_mode": True,
            "k": 0,
            "weight_sum": 0.0,
        }
        super().__init__(params, defaults)

    def _init_state(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        state = self.state[p]
        if not state:
            state["z"] = p.detach().clone()
            state["x"] = p.detach().clone()
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def eval(self) -> None:
        """Put the parameters at the averaged point x (for eval and checkpoints)."""
        for group in self.param_groups:
            if not group["train_mode"]:
                continue
            for p in group["params"]:
                p.copy_(self._init_state(p)["x"])
            group["train_mode"] = False

    @torch.no_grad()
    def train(self) -> None:
        """Put the parameters back at y, where the next gradient is taken."""
        for group in self.param_groups:
            if group["train_mode"]:
                continue
            for p in group["params"]:
                state = self._init_state(p)
                p.copy_(_interpolate(state["x"], state["z"], group["betas"][0]))
            group["train_mode"] = True

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if not group["train_mode"]:
                raise RuntimeError("ScheduleFreeAdamW.step() in eval mode: call train() first")
            self._group_step(group)
        return loss

    def _group_step(self, group: dict[str, Any]) -> None:
        beta1, beta2 = group["betas"]
        group["k"] += 1
        k, warmup = group["k"], group["warmup_steps"]
        lr = group["lr"] * (min(1.0, k / warmup) if warmup > 0 else 1.0)
        lr_t = lr * (1 - beta2**k) ** 0.5
        group["weight_sum"] += lr_t**2
        # lr 0 so far (e.g. DCP's state initialisation): keep x where it is.
        c = lr_t**2 / group["weight_sum"] if group["weight_sum"] > 0 else 0.0
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._init_state(p)
            z, x, v, g = state["z"], state["x"], state["exp_avg_sq"], p.grad
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if group["weight_decay"] != 0:
                z.sub_(p, alpha=lr_t * group["weight_decay"])  # decay at y, where g was taken
            z.addcdiv_(g, v.sqrt().add_(group["eps"]), value=-lr_t)
            x.lerp_(z, c)
            p.copy_(_interpolate(x, z, beta1))


def _interpolate(x: torch.Tensor, z: torch.Tensor, beta1: float) -> torch.Tensor:
    """y = beta1 * x + (1 - beta1) * z; train() and step() share it so y is bitwise the same."""
    return torch.lerp(x, z, 1 - beta1)
