"""build_optimizer: parameter groups with and without weight decay, and the optimizer registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.config.registry import Registry

ParamGroups = list[dict[str, Any]]
OptimizerBuilder = Callable[[ParamGroups, OptimizerConfig], torch.optim.Optimizer]
OPTIMIZERS: Registry[OptimizerBuilder] = Registry("optimizer.name")

EMBEDDING_MODULE_TYPES = (torch.nn.Embedding,)


def param_groups(model: torch.nn.Module, cfg: OptimizerConfig) -> ParamGroups:
    """Split trainable parameters into a decayed and a non-decayed group.

    Matrices decay. 1-D parameters (norm weights, biases) and embedding tables do not,
    unless cfg.decay_norms_and_biases / cfg.decay_embeddings say otherwise. A tied
    embedding/output weight is one parameter and is classified once, as an embedding.
    """
    embedding_ids = {
        id(p)
        for m in model.modules()
        if isinstance(m, EMBEDDING_MODULE_TYPES)
        for p in m.parameters(recurse=False)
    }
    decay, no_decay = [], []
    for param in model.parameters():  # de-duplicated, so a tied weight appears once
        if not param.requires_grad:
            continue
        if id(param) in embedding_ids:
            (decay if cfg.decay_embeddings else no_decay).append(param)
        elif param.ndim < 2:
            (decay if cfg.decay_norms_and_biases else no_decay).append(param)
        else:
            decay.append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _implementation_flags(cfg: OptimizerConfig, params: ParamGroups) -> dict[str, bool]:
    """foreach / fused keyword arguments for torch optimizers from optimizer.implementation."""
    choice = cfg.implementation
    if choice == "auto":
        on_cuda = all(p.is_cuda for g in params for p in g["params"])
        choice = "fused" if on_cuda else "foreach"
    if choice == "fused":
        return {"fused": True}
    return {"foreach": choice == "foreach"}


@OPTIMIZERS.register("adamw")
def build_adamw(params: ParamGroups, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        params,
        lr=cfg.lr,
        betas=(cfg.betas[0], cfg.betas[1]),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        **_implementation_flags(cfg, params),
    )


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer named by cfg.name over the model's trainable parameters."""
    return OPTIMIZERS.get(cfg.name)(param_groups(model, cfg), cfg)
