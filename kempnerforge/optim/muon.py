"""Muon: orthogonalised momentum for hidden weight matrices, AdamW for everything else."""

# torch._foreach_* are the multi-tensor ops torch's own optimizers run on, but torch's
# type stubs do not export underscored names.
# pyright: reportPrivateImportUsage=false

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw as functional_adamw

from kempnerforge.optim.foreach_optimizer import ForeachOptimizer
from kempnerforge.optim.multi_tensor import bucket, use_foreach, with_grad
from kempnerforge.optim.muon_sharded import orthogonalize_sharded, prepare_exchanges

# Quintic Newton-Schulz coefficients: they push every singular value into a band around 1
# in few steps, trading exact orthogonality (singular values end in about [0.68, 1.13]) for
# speed.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz_orthogonalize(
    matrix: torch.Tensor, steps: int, eps: float = 1e-7
) -> torch.Tensor:
    """An approximately orthogonal matrix with matrix's singular vectors (U V^T of its SVD);
    for a stack (..., rows, cols), each matrix of the stack on its own.

    Normalises by the Frobenius norm so every singular value starts in [0, 1], then runs
    ``steps`` quintic iterations X <- a X + (b A + c A^2) X with A = X X^T. A tall matrix is
    transposed first so A is the smaller Gram matrix. Runs in float32, or in float64 for a
    float64 matrix (the map's own derivatives are taken there, see tests/support/tolerance).
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(torch.promote_types(matrix.dtype, torch.float32))
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    if tall:
        x = x.mT
    return x.to(matrix.dtype)


class Muon(ForeachOptimizer):
    """Muon over groups with ``use_muon=True``, AdamW over the groups with ``use_muon=False``.

    Muon groups (2-D hidden matrices, or 3-D stacks of them): buf = momentum * buf + g; the
    Nesterov update u = g + momentum * buf is orthogonalised by Newton-Schulz (each matrix
    of a stack on its own) and applied as
    p = p * (1 - lr * weight_decay) - lr * sqrt(max(1, fan_out / fan_in)) * NS(u),
    where the group's ``fan_out_dim`` says which of the last two dimensions holds the
    outputs: -2 for nn.Linear's (out, in) weights, -1 for expert stacks (experts, in, out).
    AdamW groups (embeddings, output head, 1-D parameters): decoupled-decay AdamW with
    bias correction. Each group keeps its own lr, so a LambdaLR scales both sides from
    their own initial values. All state is per parameter, so state_dict round-trips.

    DTensor matrices (FSDP2, tensor parallelism) keep their momentum sharded like
    themselves; each whole matrix is orthogonalised once per step by one of the ranks that
    share it, and each rank applies its shard of the result (see muon_sharded).

    ``foreach``: False loops over a group's parameters; True runs the same operations as
    one foreach call per op (Newton-Schulz stays per matrix), with the same results; None
    picks per device like Lion (see use_foreach), except that AdamW groups of CPU
    parameters take torch's fused AdamW kernel, which reads the CPU step counts this state
    keeps and agrees with the other two to float rounding.
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
        *,
        foreach: bool | None = None,
    ) -> None:
        defaults = {
            "lr": lr,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "use_muon": True,
            "fan_out_dim": -2,
        }
        super().__init__(params, defaults, foreach)
        for group in self.param_groups:
            if group["use_muon"] and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError(
                    "Muon groups hold matrices (2-D) or stacks of them (3-D, one matrix per "
                    "index of dim 0); put the rest in AdamW groups"
                )
        prepare_exchanges(p for g in self.param_groups if g["use_muon"] for p in g["params"])

    def _group_step(self, group: dict[str, Any]) -> None:
        if group["use_muon"]:
            self._muon_step(group)
        else:
            self._adamw_step(group)

    def _muon_step(self, group: dict[str, Any]) -> None:
        params, grads = with_grad(group)
        bufs = [state["momentum_buffer"] for state in self._states(params, _fresh_muon_state)]
        sharded = []
        for ps, gs, bs in bucket(params, grads, bufs):
            if isinstance(ps[0], DTensor):
                sharded.append((ps, gs, bs))
            else:
                _muon_update(ps, gs, bs, group)
        if sharded:
            _sharded_muon_update(sharded, group)

    def _adamw_step(self, group: dict[str, Any]) -> None:
        params, grads = with_grad(group)
        states = self._states(params, _fresh_adamw_state)
        lists = bucket(
            params,
            grads,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
        )
        for ps, gs, ms, vs, steps in lists:
            _adamw_update(ps, gs, ms, vs, steps, group)


def _fresh_muon_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """A matrix's state before its first Muon step: the momentum buffer at zero."""
    return {"momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}


def _fresh_adamw_state(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter's state before its first AdamW step; the step count stays on the CPU."""
    return {
        "step": torch.zeros((), dtype=torch.float32),
        "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
        "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
    }


def _muon_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    bufs: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """One bucket of plain tensors' Muon step, per matrix or as foreach calls (see
    use_foreach): the same operations in the same order either way; Newton-Schulz runs per
    matrix in both."""
    lr, wd, mu = group["lr"], group["weight_decay"], group["momentum"]
    if not use_foreach(group["foreach"], params):
        for p, g, buf in zip(params, grads, bufs, strict=True):
            buf.mul_(mu).add_(g)
            update = g.add(buf, alpha=mu)  # Nesterov: look ahead along the momentum
            ortho = newton_schulz_orthogonalize(update, group["ns_steps"])
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.add_(ortho, alpha=-lr * _shape_scale(p, group))
        return
    updates = _nesterov_updates(grads, bufs, mu)
    orthos = [newton_schulz_orthogonalize(u, group["ns_steps"]) for u in updates]
    del updates
    _apply_updates(params, orthos, group)


def _sharded_muon_update(
    buckets: list[tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]],
    group: dict[str, Any],
) -> None:
    """The DTensor buckets' Muon step, as foreach calls per bucket (one mesh object each)
    around one Newton-Schulz exchange for all of them: the group's matrices are dealt to
    owners together, so each rank orthogonalises its share of the whole group, not of each
    bucket (FSDP gives every unit a mesh object of its own)."""
    updates = [_nesterov_updates(gs, bs, group["momentum"]) for _, gs, bs in buckets]
    steps = group["ns_steps"]

    def orthogonalize(matrix: torch.Tensor) -> torch.Tensor:
        # Looked up at call time, as in the plain path.
        return newton_schulz_orthogonalize(matrix, steps)

    flat = [u for bucket_updates in updates for u in bucket_updates]
    orthos = orthogonalize_sharded(flat, orthogonalize)  # type: ignore[arg-type]
    del updates, flat
    start = 0
    for ps, _, _ in buckets:
        _apply_updates(ps, orthos[start : start + len(ps)], group)
        start += len(ps)


def _nesterov_updates(
    grads: list[torch.Tensor], bufs: list[torch.Tensor], momentum: float
) -> list[torch.Tensor]:
    """buf = momentum * buf + g, then the look-ahead update g + momentum * buf."""
    torch._foreach_mul_(bufs, momentum)
    torch._foreach_add_(bufs, grads)
    return list(torch._foreach_add(grads, bufs, alpha=momentum))


def _apply_updates(
    params: list[torch.Tensor], orthos: Sequence[torch.Tensor], group: dict[str, Any]
) -> None:
    """p = p * (1 - lr * weight_decay) - lr * shape scale * ortho, as foreach calls."""
    lr, wd = group["lr"], group["weight_decay"]
    if wd != 0:
        torch._foreach_mul_(params, 1 - lr * wd)
    # One call per distinct shape scale (a handful), so each parameter gets the same single
    # add-with-alpha as in the loop.
    by_scale: dict[float, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for p, ortho in zip(params, orthos, strict=True):
        ps, os_ = by_scale.setdefault(_shape_scale(p, group), ([], []))
        ps.append(p)
        os_.append(ortho)
    for scale, (ps, os_) in by_scale.items():
        torch._foreach_add_(ps, os_, alpha=-lr * scale)


def _shape_scale(p: torch.Tensor, group: dict[str, Any]) -> float:
    """sqrt(max(1, fan_out / fan_in)): the orthogonal update of a matrix with more outputs
    than inputs has a smaller RMS. Groups saved before fan_out_dim existed held (out, in)
    matrices only."""
    fan_out_dim = group.get("fan_out_dim", -2)
    fan_in_dim = -1 if fan_out_dim == -2 else -2
    return math.sqrt(max(1.0, p.size(fan_out_dim) / p.size(fan_in_dim)))


def _adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
    group: dict[str, Any],
) -> None:
    """One bucket's AdamW step: torch's fused kernel where 'auto' can take it (see
    _fused_adamw_takes), else per parameter or as foreach calls (see use_foreach), which
    run the same operations in the same order."""
    if group["foreach"] is None and _fused_adamw_takes(params):
        functional_adamw(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            [],
            steps,
            fused=True,
            amsgrad=False,
            beta1=group["betas"][0],
            beta2=group["betas"][1],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )
        return
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    if not use_foreach(group["foreach"], params):
        for p, g, m, v, step in zip(params, grads, exp_avgs, exp_avg_sqs, steps, strict=True):
            step += 1
            t = int(step.item())
            m.lerp_(g, 1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
            if wd != 0:
                p.mul_(1 - lr * wd)
            p.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        return
    torch._foreach_add_(steps, 1)
    ts = [int(s.item()) for s in steps]  # CPU scalars: no device sync
    torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
    denoms = torch._foreach_div(exp_avg_sqs, [1 - beta2**t for t in ts])
    torch._foreach_sqrt_(denoms)
    torch._foreach_add_(denoms, eps)
    if wd != 0:
        torch._foreach_mul_(params, 1 - lr * wd)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr / (1 - beta1**t) for t in ts])


def _fused_adamw_takes(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused AdamW kernel can step these parameters with this state: it
    wants each step count on its parameter's device, and the counts live on the CPU."""
    return all(p.device.type == "cpu" and torch.is_floating_point(p) for p in params)
