"""Schedule-free AdamW: iterate averaging in place of a decaying LR schedule, with a
train/eval switch between the gradient point y and the averaged point x."""

# torch._foreach_* are the multi-tensor ops torch's own optimizers run on, but torch's
# type stubs do not export underscored names.
# pyright: reportPrivateImportUsage=false

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from kempnerforge.optim.foreach_optimizer import ForeachOptimizer
from kempnerforge.optim.multi_tensor import bucket, copy_all, use_foreach, with_grad


class ScheduleFreeAdamW(ForeachOptimizer):
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

    ``foreach``: True runs each operation as one foreach call over a group's parameters
    (per device, dtype and mesh), False loops over them, None picks per device (see
    use_foreach). Both run the same operations in the same order, in step(), eval() and
    train() alike, with the same results.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        *,
        foreach: bool | None = None,
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
        super().__init__(params, defaults, foreach)

    def _points(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The x and z of each parameter, state created where missing."""
        states = self._states(params, _fresh_state)
        return [s["x"] for s in states], [s["z"] for s in states]

    @torch.no_grad()
    def eval(self) -> None:
        """Put the parameters at the averaged point x (for eval and checkpoints)."""
        for group in self.param_groups:
            if not group["train_mode"]:
                continue
            params = list(group["params"])
            xs, _ = self._points(params)
            for ps, x in bucket(params, xs):
                copy_all(ps, x)
            group["train_mode"] = False

    @torch.no_grad()
    def train(self) -> None:
        """Put the parameters back at y, where the next gradient is taken."""
        for group in self.param_groups:
            if group["train_mode"]:
                continue
            params = list(group["params"])
            xs, zs = self._points(params)
            for ps, x, z in bucket(params, xs, zs):
                _interpolate(ps, x, z, group)
            group["train_mode"] = True

    def _group_step(self, group: dict[str, Any]) -> None:
        if not group["train_mode"]:
            raise RuntimeError("ScheduleFreeAdamW.step() in eval mode: call train() first")
        beta2 = group["betas"][1]
        group["k"] += 1
        k, warmup = group["k"], group["warmup_steps"]
        lr = group["lr"] * (min(1.0, k / warmup) if warmup > 0 else 1.0)
        lr_t = lr * (1 - beta2**k) ** 0.5
        group["weight_sum"] += lr_t**2
        # lr 0 so far (e.g. DCP's state initialisation): keep x where it is.
        c = lr_t**2 / group["weight_sum"] if group["weight_sum"] > 0 else 0.0
        params, grads = with_grad(group)
        xs, zs = self._points(params)
        vs = [self.state[p]["exp_avg_sq"] for p in params]
        for ps, gs, x, z, v in bucket(params, grads, xs, zs, vs):
            _update(ps, gs, x, z, v, group, lr_t, c)
            _interpolate(ps, x, z, group)


def _fresh_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter's state before its first step: z and x at the parameter, v at zero."""
    return {
        "z": p.detach().clone(),
        "x": p.detach().clone(),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def _update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    xs: list[torch.Tensor],
    zs: list[torch.Tensor],
    vs: list[torch.Tensor],
    group: dict[str, Any],
    lr_t: float,
    c: float,
) -> None:
    """One bucket's v, z and x, per parameter or as foreach calls (see use_foreach): the
    same operations in the same order either way."""
    beta2, wd, eps = group["betas"][1], group["weight_decay"], group["eps"]
    if not use_foreach(group["foreach"], params):
        for p, g, x, z, v in zip(params, grads, xs, zs, vs, strict=True):
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            if wd != 0:
                z.sub_(p, alpha=lr_t * wd)  # decay at y, where g was taken
            z.addcdiv_(g, v.sqrt().add_(eps), value=-lr_t)
            x.lerp_(z, c)
        return
    torch._foreach_mul_(vs, beta2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
    if wd != 0:
        torch._foreach_sub_(zs, params, alpha=lr_t * wd)  # decay at y, where g was taken
    denom = torch._foreach_sqrt(vs)
    torch._foreach_add_(denom, eps)
    torch._foreach_addcdiv_(zs, grads, denom, value=-lr_t)
    torch._foreach_lerp_(xs, zs, c)


def _interpolate(
    params: list[torch.Tensor],
    xs: list[torch.Tensor],
    zs: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """y = beta1 * x + (1 - beta1) * z into one bucket's parameters; train() and step()
    share it so y is bitwise the same. Written as p = x, then p.lerp_(z): no temporary,
    and the same lerp of (x, z) as torch.lerp(x, z, 1 - beta1)."""
    weight = 1 - group["betas"][0]
    if use_foreach(group["foreach"], params):
        copy_all(params, xs)
        torch._foreach_lerp_(params, zs, weight)
        return
    for p, x, z in zip(params, xs, zs, strict=True):
        p.copy_(x).lerp_(z, weight)
