"""build_optimizer: parameter groups with and without weight decay, the optimizer registry,
and the train/eval switch that schedule-free optimizers need."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from kempnerforge.config.optimizer import OptimizerConfig, fused_unsupported
from kempnerforge.config.registry import Registry
from kempnerforge.optim.lion import Lion
from kempnerforge.optim.muon import Muon
from kempnerforge.optim.schedule_free import ScheduleFreeAdamW

# Each group: "params" (tensors), "weight_decay", and "names" (the parameters' qualified
# names, same order). Builders that hand groups to torch drop "names" with tensor_groups().
ParamGroups = list[dict[str, Any]]
OptimizerBuilder = Callable[[ParamGroups, OptimizerConfig], torch.optim.Optimizer]
OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer.name")

EMBEDDING_MODULE_TYPES = (torch.nn.Embedding,)


STACKED_BIASES = ("experts.b1", "experts.b2", "experts.b3")
"""Biases that are 2-D only because they are stacked per expert (model.moe_expert_bias,
(experts, width)): biases for decay and for Muon, which must not orthogonalise them."""


def param_groups(
    model: torch.nn.Module, cfg: OptimizerConfig, *, with_names: bool = False
) -> ParamGroups:
    """Split the parameters into a decayed and a non-decayed group.

    Frozen parameters (requires_grad False) are included: they have no gradient, so every
    optimizer here skips them, and a freeze schedule that unfreezes them later trains them
    with the optimizer as built (training/freeze.py), instead of leaving them out for good.

    Matrices decay. 1-D parameters (norm weights, biases), the experts' stacked biases and
    embedding tables do not, unless cfg.decay_norms_and_biases / cfg.decay_embeddings say
    otherwise. A tied
    embedding/output weight is one parameter and is classified once, as an embedding.
    with_names adds each group's "names" (qualified parameter names, in "params" order).
    """
    embedding_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, EMBEDDING_MODULE_TYPES)
        for p in m.parameters(recurse=False)
    }
    if getattr(model, "tied_head_copy", False):
        # A pipeline rank's copy of a tied embedding (model/contract.py) is the embedding.
        embedding_ids.add(id(model.get_parameter("output.weight")))
    decay: list[tuple[str, torch.nn.Parameter]] = []
    no_decay: list[tuple[str, torch.nn.Parameter]] = []
    for name, param in model.named_parameters():  # de-duplicated: a tied weight appears once
        if id(param) in embedding_ids:
            (decay if cfg.decay_embeddings else no_decay).append((name, param))
        elif param.ndim < 2 or name.endswith(STACKED_BIASES):
            (decay if cfg.decay_norms_and_biases else no_decay).append((name, param))
        else:
            decay.append((name, param))
    groups = [_group(decay, cfg.weight_decay, with_names)]
    if no_decay:
        groups.append(_group(no_decay, 0.0, with_names))
    return groups


def _group(
    named: list[tuple[str, torch.nn.Parameter]], weight_decay: float, with_names: bool
) -> dict[str, Any]:
    group: dict[str, Any] = {"params": [p for _, p in named], "weight_decay": weight_decay}
    if with_names:
        group["names"] = [n for n, _ in named]
    return group


def tensor_groups(params: ParamGroups) -> ParamGroups:
    """The groups without their "names", as torch optimizers (and their state_dict) want."""
    return [{k: v for k, v in g.items() if k != "names"} for g in params]


def fused_adamw_supported(params: ParamGroups) -> bool:
    """Whether torch's fused AdamW kernel takes every parameter: floating point, on a device
    type it has a kernel for (CUDA and CPU among them).

    DTensor parameters (FSDP2, TP) qualify by their local device: the fused op has a
    DTensor sharding rule, and the step count it keeps is a plain scalar tensor.
    """
    devices = _get_fused_kernels_supported_devices()
    return all(
        p.device.type in devices and torch.is_floating_point(p) for g in params for p in g["params"]
    )


def _adamw_flags(cfg: OptimizerConfig, params: ParamGroups) -> dict[str, bool]:
    """foreach / fused keyword arguments for torch's AdamW from optimizer.implementation.

    'auto' is fused wherever the kernel takes the parameters (one pass over memory, several
    times faster than foreach on CPU too), else foreach. It depends only on the config and
    the parameters' devices and dtypes, so a resumed run resolves it the same way.
    """
    choice = cfg.implementation
    if choice == "auto":
        choice = "fused" if fused_adamw_supported(params) else "foreach"
    if choice == "fused":
        return {"fused": True}
    return {"foreach": choice == "foreach"}


def _foreach_flag(cfg: OptimizerConfig) -> bool | None:
    """The ``foreach`` argument of Lion, Muon and schedule-free AdamW: None ('auto', the
    optimizer picks its fastest path), True ('foreach') or False ('for_loop')."""
    # Config validation refuses this for the built-in names; a builder registered under
    # another name, or a field set after validation, still ends here.
    if cfg.implementation == "fused":
        raise fused_unsupported(cfg.name)
    return {"auto": None, "foreach": True, "for_loop": False}[cfg.implementation]


@OPTIMIZERS.register("adamw")
def build_adamw(params: ParamGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    params = tensor_groups(params)
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **_adamw_flags(cfg, params),
    )


@OPTIMIZERS.register("lion")
def build_lion(params: ParamGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return Lion(
        tensor_groups(params),
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        weight_decay=cfg.weight_decay,
        foreach=_foreach_flag(cfg),
    )


# Matrices that Muon leaves to AdamW: lookups, the logit projection, the MoE routers'
# gates (a few rows of logits, not a hidden layer) and the experts' stacked biases.
MUON_EXCLUDED_SUFFIXES = (
    "tok_embeddings.weight",
    "output.weight",
    "position_embedding",
    "router.gate.weight",
    *STACKED_BIASES,
)


@OPTIMIZERS.register("muon")
def build_muon(params: ParamGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """Muon over the decayed group's hidden matrices; AdamW (lr muon_adam_lr) for the rest.

    Hidden matrices are the 2-D weights (nn.Linear's (out, in)) and the 3-D expert stacks
    (GroupedExperts' (experts, in, out): one matrix per expert, applied as rows @ w[e]),
    which get a Muon group of their own whose fan_out_dim says where their outputs are."""
    adam_lr = cfg.muon_adam_lr or cfg.lr
    groups: ParamGroups = []
    for index, group in enumerate(params):
        matrices, stacks, adam_side = [], [], []
        for name, p in zip(group["names"], group["params"], strict=True):
            # Group 0 is the decayed group: the non-decayed one never feeds Muon.
            hidden = index == 0 and p.ndim in (2, 3) and not name.endswith(MUON_EXCLUDED_SUFFIXES)
            if not hidden:
                adam_side.append(p)
            else:
                (matrices if p.ndim == 2 else stacks).append(p)
        wd = group["weight_decay"]
        if matrices:
            groups.append({"params": matrices, "weight_decay": wd, "use_muon": True})
        if stacks:
            groups.append(
                {"params": stacks, "weight_decay": wd, "use_muon": True, "fan_out_dim": -1}
            )
        if adam_side:
            groups.append(
                {"params": adam_side, "weight_decay": wd, "use_muon": False, "lr": adam_lr}
            )
    groups.sort(key=lambda g: not g["use_muon"])  # group 0 (the LR the loop logs) is Muon's
    return Muon(
        groups,
        lr=cfg.lr,
        momentum=cfg.muon_momentum,
        ns_steps=cfg.muon_ns_steps,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=_foreach_flag(cfg),
    )


@OPTIMIZERS.register("schedule_free_adamw")
def build_schedule_free_adamw(params: ParamGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return ScheduleFreeAdamW(
        tensor_groups(params),
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        warmup_steps=cfg.schedule_free_warmup_steps,
        foreach=_foreach_flag(cfg),
    )


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer named by cfg.name over the model's trainable parameters.

    Builders receive param_groups(model, cfg, with_names=True).
    """
    return OPTIMIZERS.get(cfg.name)(param_groups(model, cfg, with_names=True), cfg)


def set_optimizer_mode(optimizer: torch.optim.Optimizer, training: bool) -> None:
    """Put the parameters where this optimizer trains (True) or evaluates (False).

    Schedule-free optimizers keep two points: gradients are taken at y, evaluation and
    checkpoints use the average x. For every other optimizer this does nothing.
    """
    if isinstance(optimizer, ScheduleFreeAdamW):
        optimizer.train() if training else optimizer.eval()


@contextmanager
def optimizer_eval_mode(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Parameters at the optimizer's evaluation point inside the block, restored after.

    Wrap evaluation and checkpoint saves in it. Restoring is exact: the training point is
    recomputed from the optimizer's state with the same expression that produced it.
    """
    set_optimizer_mode(optimizer, False)
    try:
        yield
    finally:
        set_optimizer_mode(optimizer, True)
