"""The Mixture-of-Experts feed-forward: a router, routed experts, optional shared experts.

Each token goes to ``moe_top_k`` of ``num_experts`` SwiGLU experts and gets back their
outputs weighted by the router's gate values, plus the shared experts' output when there
are any. Two routers:

- 'softmax' (Switch / Mixtral): softmax over the router logits, the top k, gate values
  renormalised over the k chosen (k = 1 keeps the raw probability, or the router would
  get no gradient through the gate); balanced by the auxiliary loss.
- 'sigmoid' (DeepSeek-V3): sigmoid scores; the top k are chosen on score + expert_bias,
  but the gate values use the scores alone, so the bias never carries a gradient. The
  bias is a buffer that only the balancing rule changes (update_expert_bias, after each
  optimizer step, from the step's load summed over every data-parallel rank).

Both routers compute in fp32 whatever the autocast, and both report a z-loss. The layer
keeps its last forward's losses and counts (``last``) for add_router_losses and the metrics;
it reads nothing to the host with the grouped matmul on one rank, capacity factor or not;
expert parallelism reads the split sizes (one read per exchange), and the padded expert
compute reads the largest group.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.experts import GroupedExperts
from kempnerforge.model.mlp import SwiGLU
from kempnerforge.model.token_exchange import combine_tokens, dispatch_tokens


@dataclass
class Routing:
    """One forward's routing decision over T tokens."""

    expert_ids: torch.Tensor
    """(T, k) int64: the experts each token goes to, best first."""
    gates: torch.Tensor
    """(T, k) fp32: the weight of each chosen expert's output."""
    probs: torch.Tensor
    """(T, E) fp32: the routing distribution the balancing loss pushes towards uniform."""
    logits: torch.Tensor
    """(T, E) fp32: the router logits (for the z-loss)."""


@dataclass
class RouterStats:
    """What one forward of an MoE layer leaves for the loss and the metrics."""

    aux_loss: torch.Tensor
    """Load-balancing loss, 0-d fp32 with gradient (1.0 for a perfectly even router)."""
    z_loss: torch.Tensor
    """Router z-loss, 0-d fp32 with gradient."""
    load: torch.Tensor
    """(E,) fp32: assignments routed to each expert on this rank, before any drop."""
    dropped: torch.Tensor
    """0-d fp32: assignments dropped by the capacity limit on this rank."""


class Router(nn.Module):
    """Token -> (experts, gate values): a bias-free linear map to one logit per expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.moe_router
        self.top_k = cfg.moe_top_k
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=False)
        """Router weights (experts, dim)."""
        self.expert_bias: torch.Tensor | None
        """Sigmoid router: per-expert fp32 offset added to the scores when choosing experts
        only; changed by update_expert_bias, never by the optimizer. Saved with the model."""
        bias = torch.zeros(cfg.num_experts) if self.kind == "sigmoid" else None
        self.register_buffer("expert_bias", bias, persistent=True)

    def forward(self, tokens: torch.Tensor) -> Routing:
        with torch.autocast(tokens.device.type, enabled=False):
            logits = F.linear(tokens.float(), self.gate.weight.float())
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1)
            gates, expert_ids = probs.topk(self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            assert self.expert_bias is not None
            _, expert_ids = (scores.detach() + self.expert_bias).topk(self.top_k, dim=-1)
            gates = scores.gather(-1, expert_ids)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        return Routing(expert_ids, gates, probs, logits)


class MoEFeedForward(nn.Module):
    """Routed experts (and shared ones) in place of a block's dense SwiGLU.

    ``ep_group`` (set by the parallelizer) is the process group the experts are split
    over, None when this rank holds every expert; ``balance_group`` the data-parallel
    group whose load counts the token-level balancing loss sums, so the loss is the one
    a single process would compute over the whole batch.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_level = cfg.moe_aux_loss_level
        self.router = Router(cfg)
        """Chooses each token's experts."""
        self.experts = GroupedExperts(cfg.num_experts, cfg.dim, cfg.expert_hidden_dim)
        """The routed experts' stacked weights."""
        self.shared: SwiGLU | None = None
        """Shared experts (every token), as one SwiGLU of moe_shared_experts times the
        expert width: the same function as that many experts summed."""
        if cfg.moe_shared_experts:
            self.shared = SwiGLU(cfg.dim, cfg.moe_shared_experts * cfg.expert_hidden_dim)
        self.ep_group: dist.ProcessGroup | None = None
        self.balance_group: dist.ProcessGroup | None = None
        self.last: RouterStats | None = None
        """The latest forward's losses and counts."""
        self.totals: StepTotals | None = None
        """This step's sums of ``last`` over micro-batches (record_router_stats)."""
        self.step = 0
        """The optimizer step being taken (begin_router_step), for the bias schedule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens)
        flat_ids = routing.expert_ids.reshape(-1)  # assignment q = token * k + slot
        load = _expert_counts(flat_ids, self.num_experts)
        keep = self._within_capacity(routing.expert_ids)
        out = self._run_experts(tokens, routing, flat_ids, load, keep)
        if self.shared is not None:
            out = out + self.shared(tokens)
        dropped = (
            torch.zeros((), device=x.device) if keep is None else (~keep).sum().to(torch.float32)
        )
        self.last = RouterStats(
            aux_loss=self._balance_loss(routing, load, batch, seq),
            z_loss=torch.logsumexp(routing.logits, dim=-1).square().mean(),
            load=load.to(torch.float32),
            dropped=dropped,
        )
        return out.reshape(batch, seq, -1)

    def forward_inference(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's output for x (batch, seq, dim) when decoding: the same routing and
        experts as forward, but no capacity limit and nothing recorded.

        ``last`` (and so the step totals and the balancing bias built from it) is left as
        it is, so decoding between training steps changes no training statistic. A
        capacity limit would depend on how many tokens one call holds (a single new token
        during cached decoding), so every assignment is kept; for a dropless layer
        (moe_capacity_factor unset) the result equals forward's.
        """
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(tokens)
        flat_ids = routing.expert_ids.reshape(-1)
        load = _expert_counts(flat_ids, self.num_experts)
        out = self._run_experts(tokens, routing, flat_ids, load, None)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(batch, seq, -1)

    def _within_capacity(self, expert_ids: torch.Tensor) -> torch.Tensor | None:
        """(T, k) bool: which assignments fit their expert's capacity; None when dropless.

        Capacity is ceil(factor * T * k / E) slots per expert. First choices claim slots
        before second choices, and earlier tokens before later ones within a choice.
        """
        if self.capacity_factor is None:
            return None
        tokens, k = expert_ids.shape
        capacity = math.ceil(self.capacity_factor * tokens * k / self.num_experts)
        by_priority = expert_ids.t().reshape(-1)  # slot-major: all first choices first
        one_hot = F.one_hot(by_priority, self.num_experts)
        position = (one_hot.cumsum(0) * one_hot).sum(-1) - 1
        return (position < capacity).reshape(k, tokens).t()

    def _run_experts(
        self,
        tokens: torch.Tensor,
        routing: Routing,
        flat_ids: torch.Tensor,
        load: torch.Tensor,
        keep: torch.Tensor | None,
    ) -> torch.Tensor:
        """Sort the kept assignments by expert, run the experts, weight and sum per token.

        ``load`` is the routed count per expert, which is the kept count when dropless.
        Dropped assignments sort last, under a virtual expert E, outside every expert's
        group: the experts give them zero rows (no host read), and the token exchange
        does not send them (its one read of the split sizes says how many it sent)."""
        k, experts = self.top_k, self.num_experts
        key = flat_ids if keep is None else torch.where(keep.reshape(-1), flat_ids, experts)
        order = torch.argsort(key, stable=True)
        counts = load if keep is None else _expert_counts(key, experts)
        # One copy of each token per slot, then a permutation: every index is taken once,
        # so backward never adds into one row from two places (no atomics, same bits on
        # every run), unlike gathering tokens[order // k].
        rows = tokens.unsqueeze(1).expand(-1, k, -1).reshape(-1, tokens.shape[1])[order]
        if self.ep_group is None:
            out_rows = self.experts(rows, counts)
        else:
            local_rows, local_counts, plan = dispatch_tokens(rows, counts, self.ep_group)
            out_rows = combine_tokens(self.experts(local_rows, local_counts), plan)
            order = order[: out_rows.shape[0]]  # the sent (kept) rows, known from the plan
        gates = routing.gates.reshape(-1)[order]
        weighted = (out_rows.float() * gates[:, None]).to(out_rows.dtype)
        # Each assignment has its own row, so this scatter never adds: deterministic on
        # every device, unlike an index_add over tokens.
        slots = out_rows.new_zeros(tokens.shape[0] * k, out_rows.shape[1])
        slots = slots.index_put((order,), weighted)
        return slots.reshape(tokens.shape[0], k, -1).sum(1)

    def _balance_loss(
        self, routing: Routing, load: torch.Tensor, batch: int, seq: int
    ) -> torch.Tensor:
        """E * sum_i f_i * P_i: f_i the share of assignments routed to expert i (no
        gradient), P_i the mean routing probability of expert i (with gradient).

        Token level: f from the load summed over the data-parallel ranks (in training),
        P over this rank's tokens, so the ranks' mean loss equals the whole batch's.
        Sequence level: f and P per sequence, averaged over sequences.
        """
        experts, k = self.num_experts, self.top_k
        if self.aux_level == "sequence":
            one_hot = F.one_hot(routing.expert_ids.reshape(batch, seq * k), experts)
            share = one_hot.sum(1).float() / (seq * k)  # (batch, E)
            mean_prob = routing.probs.reshape(batch, seq, experts).mean(1)
            return experts * (share * mean_prob).sum(-1).mean()
        counts = load.to(torch.float32).detach()
        if self.training and torch.is_grad_enabled() and self.balance_group is not None:
            counts = counts.clone()
            dist.all_reduce(counts, group=self.balance_group)
        share = counts / counts.sum().clamp(min=1.0)
        return experts * (share * routing.probs.mean(0)).sum()


def _expert_counts(sorted_or_not: torch.Tensor, experts: int) -> torch.Tensor:
    """(E,) int64 occurrences of 0..E-1 in a 1-D id tensor (values >= E are ignored).

    A comparison against each expert id, summed: deterministic on every device, which
    bincount on CUDA is not declared to be."""
    ids = torch.arange(experts, device=sorted_or_not.device)
    return (sorted_or_not[:, None] == ids).sum(0)


# --- Per-step bookkeeping: the training step's side of the routers ---------------------
#
# Every function below does nothing for a model without MoE layers (moe_layers is empty,
# and found once per model), so the step bodies and the loop call them unconditionally.


@dataclass
class StepTotals:
    """One MoE layer's sums over the micro-batches of the current step (this rank)."""

    load: torch.Tensor
    """(E,) fp64 assignments routed to each expert."""
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    dropped: torch.Tensor
    assignments: torch.Tensor
    micro_batches: torch.Tensor


_LAYERS_ATTR = "_kempnerforge_moe_layers"


def moe_layers(model: nn.Module) -> list[MoEFeedForward]:
    """The MoE layers of ``model`` in layer order, found once and remembered on the model,
    so the per-micro-batch callers do not walk every module each time."""
    found = model.__dict__.get(_LAYERS_ATTR)
    if found is None:
        found = [m for m in model.modules() if isinstance(m, MoEFeedForward)]
        model.__dict__[_LAYERS_ATTR] = found
    return found


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
    if not layers or not (nudge or with_metrics):
        return None
    rows = []
    for layer in layers:
        t = layer.totals
        assert t is not None
        scalars = torch.stack([t.aux_loss, t.z_loss, t.dropped, t.assignments, t.micro_batches])
        rows.append(torch.cat([t.load, scalars]))
    totals = torch.stack(rows)
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
