"""The router terms of an MoE model split into pipeline stages.

A pipeline stage has no scalar objective of its own: torch's schedule runs each stage's
backward from the gradient the next stage sends (the last stage's from the loss). So each
stage adds its own layers' router terms to its backward through its output
(carry_router_losses) and keeps each forward's router statistics until the step's
forwards are done (record_stage_router_stats); the biases then move per stage, and on log
steps finish_router_step sums the stages' per-layer rows over the pipeline group, so
every rank logs every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.moe.layer import RouterStats, moe_layers
from kempnerforge.model.moe.router_step import add_router_losses, add_to_step_totals

_PENDING_ATTR = "_kempnerforge_router_forwards"
"""A stage's list of its forwards' router statistics, one list of layers per forward."""


class _AddToBackward(torch.autograd.Function):
    """Identity on ``output`` whose backward also seeds ``term`` with gradient 1.

    Backward from the stage output then carries d(term)/d(parameters) as if ``term`` had
    been added to the objective: the stage's parameters get the router terms' gradient in
    the same backward pass as the language-model loss's."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.term_dtype, ctx.term_device = term.dtype, term.device
        # The same storage as a new tensor, not a view: FSDP warns about a root whose
        # output is a view.
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.ones((), dtype=ctx.term_dtype, device=ctx.term_device)


def carry_router_losses(
    output: torch.Tensor | tuple[torch.Tensor, ...],
    stage: nn.Module,
    cfg: ModelConfig,
    micro_batches: int,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``output`` of one pipeline stage's forward, with the router terms of the stage's MoE
    layers (their latest forward) added to its backward.

    Each micro-batch carries 1/micro_batches of its terms, as add_micro_batch_router_losses
    adds them in a step without pipeline, so the step's gradient holds their mean over the
    micro-batches. A stage without MoE layers, or with both router weights 0, gets
    ``output`` back as it is. A last stage that computes its own loss returns a tuple
    (the summed loss first, then the detached per-token losses): the terms ride on the loss.
    """
    if not moe_layers(stage):
        return output
    carrier = output[0] if isinstance(output, tuple) else output
    zero = torch.zeros((), device=carrier.device)
    term = add_router_losses(zero, stage, cfg)
    if term is zero:
        return output
    carried = _AddToBackward.apply(carrier, term / micro_batches)
    return (carried, *output[1:]) if isinstance(output, tuple) else carried


def attach_stage_router_hooks(
    stages: Sequence[nn.Module], cfg: ModelConfig, micro_batches: int
) -> None:
    """Make every training forward of each stage keep its MoE layers' statistics and carry
    their router terms into its backward (carry_router_losses).

    A forward hook on the stage module, so a block recomputed by activation checkpointing
    (inside the stage) is not seen twice, and a forward without gradients (evaluation)
    does nothing. Stages without MoE layers get no hook.
    """
    for stage in stages:
        if not moe_layers(stage):
            continue
        stage.__dict__[_PENDING_ATTR] = []

        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            if not (module.training and torch.is_grad_enabled()):
                return None
            forwards: list[list[RouterStats | None]] = module.__dict__[_PENDING_ATTR]
            forwards.append([_detached(layer.last) for layer in moe_layers(module)])
            return carry_router_losses(output, module, cfg, micro_batches)

        stage.register_forward_hook(hook)


def _detached(stats: RouterStats | None) -> RouterStats | None:
    """The statistics without their graph, so keeping them holds no activations."""
    if stats is None:
        return None
    return RouterStats(stats.aux_loss.detach(), stats.z_loss.detach(), stats.load, stats.dropped)


def record_stage_router_stats(stages: list[nn.Module], micro_batches: int) -> None:
    """Add the step's forwards of each stage to its MoE layers' step totals, then forget them.

    Only the last ``micro_batches`` forwards of a stage count: torch's schedule runs one
    more forward, on the first step, to learn the shapes the stages exchange (on stages
    after the first, of uninitialised inputs), and it is not a micro-batch of the step.
    """
    for stage in stages:
        forwards = stage.__dict__.get(_PENDING_ATTR)
        if not forwards:
            continue
        for per_layer in forwards[-micro_batches:]:
            for layer, stats in zip(moe_layers(stage), per_layer, strict=True):
                if stats is not None:
                    add_to_step_totals(layer, stats)
        forwards.clear()
