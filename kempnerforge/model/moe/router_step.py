"""The training step's side of the MoE routers: their losses, the step's totals over
micro-batches, the sigmoid routers' bias nudge and the router metrics.

Every function here does nothing for a model without MoE layers (moe_layers is empty, and
found once per model), so the step bodies and the loop call them unconditionally.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.moe.layer import MoEFeedForward, Router, RouterStats, StepTotals, moe_layers


def add_router_losses(loss: torch.Tensor, model: nn.Module, cfg: ModelConfig) -> torch.Tensor:
    """``loss`` plus the router terms of every MoE layer's latest forward.

    moe_aux_loss_weight times the summed load-balancing losses, plus
    moe_router_z_loss_weight times the summed z-losses. A model without MoE layers, or a
    weight of 0, adds nothing (and no graph): ``loss`` comes back as it is.
    """
    stats = [layer.last for layer in moe_layers(model) if layer.last is not None]
    if stats and cfg.moe_aux_loss_weight > 0:
        loss = loss + cfg.moe_aux_loss_weight * torch.stack([s.aux_loss for s in stats]).sum()
    if stats and cfg.moe_router_z_loss_weight > 0:
        z = torch.stack([s.z_loss for s in stats]).sum()
        loss = loss + cfg.moe_router_z_loss_weight * z
    return loss


def add_micro_batch_router_losses(
    objective: torch.Tensor, model: nn.Module, cfg: ModelConfig, micro_batches: int
) -> torch.Tensor:
    """One micro-batch's training objective plus its share of the step's router terms.

    The router terms are per-micro-batch means, so each micro-batch adds 1/micro_batches
    of them and the step's gradient holds their mean over its micro-batches. The
    objective of a model without MoE layers comes back untouched (not even rescaled).
    """
    if not moe_layers(model):
        return objective
    return add_router_losses(objective * micro_batches, model, cfg) / micro_batches


def begin_router_step(model: nn.Module, step: int) -> None:
    """Start a step's bookkeeping: zero every layer's totals and hand the layers the
    optimizer step about to be taken (the bias schedule depends on it)."""
    for layer in moe_layers(model):
        layer.step = step
        layer.totals = None


def record_router_stats(model: nn.Module) -> None:
    """Add each layer's last forward (one micro-batch) to the step's totals, on the device."""
    for layer in moe_layers(model):
        if layer.last is not None:
            add_to_step_totals(layer, layer.last)


def add_to_step_totals(layer: MoEFeedForward, stats: RouterStats) -> None:
    """Add one micro-batch's ``stats`` of ``layer`` to its step totals, detached."""
    one = torch.ones((), dtype=torch.float64, device=stats.load.device)
    values = StepTotals(
        load=stats.load.detach().double(),
        aux_loss=stats.aux_loss.detach().double(),
        z_loss=stats.z_loss.detach().double(),
        dropped=stats.dropped.double(),
        assignments=stats.load.sum().double(),
        micro_batches=one,
    )
    totals = layer.totals
    if totals is None:
        layer.totals = values
        return
    for name in values.__dataclass_fields__:
        setattr(totals, name, getattr(totals, name) + getattr(values, name))


def bias_rate_factor(schedule: str, step: int, max_steps: int) -> float:
    """Multiplier of model.moe_bias_update_rate at optimizer step ``step`` (0-based)."""
    if schedule == "linear_warmup":
        return min(1.0, (step + 1) / max(1.0, 0.1 * max_steps))
    if schedule == "cosine_decay":
        return 0.5 * (1.0 + math.cos(math.pi * min(step, max_steps) / max(max_steps, 1)))
    return 1.0


def finish_router_step(
    model: nn.Module,
    cfg: ModelConfig,
    group: dist.ProcessGroup | None,
    *,
    max_steps: int,
    with_metrics: bool,
    stage_group: dist.ProcessGroup | None = None,
) -> dict[str, object] | None:
    """After a good optimizer step: nudge the sigmoid routers' biases, and on log steps
    return the step's router metrics.

    The loads are summed over ``group`` (the data-parallel ranks) in one collective, so
    every rank moves its copy of each bias by the same amount. Each bias moves by
    rate * sign(mean load - expert load): towards more tokens for an underused expert.
    Metrics: moe/aux_loss and moe/z_loss (summed over layers, mean over micro-batches and
    ranks), moe/load (tokens per expert, per layer, the whole step), moe/imbalance (max
    over mean load, worst layer) and moe/dropped_share. Under pipeline parallelism
    (``stage_group``, the pipeline group) each rank holds some of the layers: the biases
    move from its own layers' loads, and on log steps the layers' rows are summed over
    the stages in one more collective, so every rank reports every layer.
    """
    layers = [layer for layer in moe_layers(model) if layer.totals is not None]
    nudge = cfg.moe_router == "sigmoid" and cfg.moe_bias_update_rate > 0
    if not layers and with_metrics and stage_group is not None and cfg.is_moe:
        # A stage of dense layers only (model.moe_first_dense_layers, model.moe_frequency)
        # still joins the stages' sum, or the stages holding MoE layers wait for it.
        device = next(model.parameters()).device
        empty = torch.zeros(0, cfg.num_experts + 5, dtype=torch.float64, device=device)
        return _metrics_row(
            _sum_over_stages(model, empty, cfg, stage_group).tolist(), cfg.num_experts
        )
    if not layers or not (nudge or with_metrics):
        return None
    totals = _totals_rows(layers)
    if group is not None:
        dist.all_reduce(totals, group=group)
    experts = cfg.num_experts
    loads = totals[:, :experts]
    if nudge:
        step = layers[0].step
        rate = cfg.moe_bias_update_rate * bias_rate_factor(cfg.moe_bias_schedule, step, max_steps)
        for layer, load in zip(layers, loads, strict=True):
            update_expert_bias(layer.router, load, rate)
    if not with_metrics:
        return None
    if stage_group is not None:
        totals = _sum_over_stages(model, totals, cfg, stage_group)
    return _metrics_row(totals.tolist(), experts)


def _totals_rows(layers: list[MoEFeedForward]) -> torch.Tensor:
    """(layers, E + 5) fp64: each layer's step load, then its aux loss, z-loss, dropped
    assignments, assignments and micro-batches."""
    rows = []
    for layer in layers:
        t = layer.totals
        assert t is not None
        scalars = torch.stack([t.aux_loss, t.z_loss, t.dropped, t.assignments, t.micro_batches])
        rows.append(torch.cat([t.load, scalars]))
    return torch.stack(rows)


def sum_step_totals(model: nn.Module, sum_: Callable[[torch.Tensor], None]) -> None:
    """Sum every MoE layer's step totals in place with ``sum_``, one collective of (MoE
    layers, E + 5) values.

    Replica groups sum them over the step's quorum before it commits: the sigmoid routers'
    bias step then moves every group's biases by the same amount (the whole job's load,
    not this group's share), so the groups' models stay equal, and the router metrics are
    the job's.
    """
    layers = [layer for layer in moe_layers(model) if layer.totals is not None]
    if not layers:
        return
    rows = _totals_rows(layers)
    sum_(rows)
    experts = rows.shape[1] - 5
    for layer, row in zip(layers, rows, strict=True):
        aux, z, dropped, assignments, micro = row[experts:].unbind()
        layer.totals = StepTotals(row[:experts], aux, z, dropped, assignments, micro)


_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _sum_over_stages(
    model: nn.Module, rows: torch.Tensor, cfg: ModelConfig, group: dist.ProcessGroup
) -> torch.Tensor:
    """Every MoE layer's row, from this pipeline rank's rows (one per layer with totals,
    in order), placed by the layer's position among the whole model's MoE layers (found
    from its name, ``layers.5.feed_forward``) and summed over the pipeline group: each
    layer lives on one stage. One all-reduce of (MoE layers, E + 5) values."""
    held = [layer for layer in moe_layers(model) if layer.totals is not None]
    index_of = {id(m): name for name, m in model.named_modules()}
    ordinals = []
    for layer in held:
        found = _LAYER_INDEX.search(index_of[id(layer)] + ".")
        assert found is not None, f"MoE layer {index_of[id(layer)]} is not under layers.N"
        ordinals.append(sum(cfg.is_moe_layer(i) for i in range(int(found.group(1)))))
    table = rows.new_zeros(cfg.num_moe_layers, rows.shape[1])
    if ordinals:
        table[torch.tensor(ordinals, device=rows.device)] = rows
    dist.all_reduce(table, group=group)
    return table


@torch.no_grad()
def update_expert_bias(router: Router, load: torch.Tensor, rate: float) -> None:
    """Move the sigmoid router's bias by ``rate`` towards balance (see finish_router_step)."""
    if router.expert_bias is None:
        return
    error = load.mean() - load
    router.expert_bias.add_(torch.sign(error).to(router.expert_bias.dtype), alpha=rate)


def _metrics_row(values: list[list[float]], experts: int) -> dict[str, object]:
    aux = z = dropped = assignments = 0.0
    loads, imbalance = [], 0.0
    for row in values:
        load = row[:experts]
        layer_aux, layer_z, layer_dropped, layer_assignments, micro = row[experts:]
        aux += layer_aux / max(micro, 1.0)
        z += layer_z / max(micro, 1.0)
        dropped += layer_dropped
        assignments += layer_assignments
        mean = sum(load) / experts
        imbalance = max(imbalance, max(load) / mean if mean > 0 else 0.0)
        loads.append([int(round(v)) for v in load])
    return {
        "moe/aux_loss": aux,
        "moe/z_loss": z,
        "moe/imbalance": imbalance,
        "moe/dropped_share": dropped / assignments if assignments else 0.0,
        "moe/load": loads,
    }
