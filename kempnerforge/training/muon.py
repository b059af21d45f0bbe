"""Muon: orthogonalised momentum for hidden weight matrices, AdamW for everything else."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

# Quintic Newton-Schulz coefficients: they push every singular value into a band around 1
# in few steps, trading exact orthogonality (singular values end in about [0.68, 1.13]) for
# speed.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_orthogonalize(
    matrix: torch.Tensor, steps: int, eps: float = 1e-7
) -> torch.Tensor:
    """An approximately orthogonal matrix with matrix's singular vectors (U V^T of its SVD).

    Normalises by the Frobenius norm so every singular value starts in [0, 1], then runs
    ``steps`` quintic iterations X <- a X + (b A + c A^2) X with A = X X^T. A tall matrix is
    transposed first so A is the smaller Gram matrix.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.float()
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.T
    return x.to(matrix.dtype)


class Muon(torch.optim.Optimizer):
    """Muon over groups with ``use_muon=True``, AdamW over the groups with ``use_muon=False``.

    Muon groups (2-D hidden matrices): buf = momentum * buf + g; the Nesterov update
    u = g + momentum * buf is orthogonalised by Newton-Schulz and applied as
    p = p * (1 - lr * weight_decay) - lr * sqrt(max(1, rows / cols)) * NS(u).
    AdamW groups (embeddings, output head, 1-D parameters): decoupled-decay AdamW with
    bias correction. Each group keeps its own lr, so a LambdaLR scales both sides from
    their own initial values. All state is per parameter, so state_dict round-trips.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.02,
        momentum: float = 0.95,
        ns_steps: int = 5,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "use_muon": True,
        }
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim != 2 for p in group["params"]):
                raise ValueError("Muon groups hold 2-D matrices only; put the rest in AdamW groups")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(p.grad)
            update = p.grad.add(buf, alpha=mu)  # Nesterov: look ahead along the momentum
            ortho = newton_schulz_orthogonalize(update, group["ns_steps"])
            scale = math.sqrt(max(1.0, p.size(0) / p.size(1)))
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-lr * scale)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] += 1
            t = int(state["step"].item())
            m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
