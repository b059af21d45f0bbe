"""The Mixture-of-Experts feed-forward: a router, routed experts, optional shared experts.

Each token goes to ``moe_top_k`` of ``num_experts`` SwiGLU experts and gets back their
outputs weighted by the router's gate values, plus the shared experts' output when there
are any. Two routers:

- 'softmax' (Switch / Mixtral): softmax over the router logits, the top k, gate values
  renormalised over the k chosen (k = 1 keeps the raw probability, or the router would
  get no gradient through the gate); balanced by the auxiliary loss.
- 'sigmoid' (DeepSeek-V3): sigmoid scores; the top k are chosen on score + expert_bias,
  within the best model.moe_top_groups of model.moe_num_groups expert groups when
  routing is group-limited (each group ranked by its two best biased scores), but the
  gate values use the scores alone, so the bias never carries a gradient. The
  bias is a buffer that only the balancing rule changes (update_expert_bias, after each
  optimizer step, from the step's load summed over every data-parallel rank).

Both routers compute in fp32 whatever the autocast, and both report a z-loss; the gates
are multiplied by model.moe_routed_scaling after any renormalisation. The layer
keeps its last forward's losses and counts (``last``) for the step's router losses and
metrics (router_step.py); it reads nothing to the host with the grouped matmul on one rank,
capacity factor or not; expert parallelism reads the split sizes (one read per exchange),
and the padded expert compute reads the largest group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention import SequenceSplit, active_split
from kempnerforge.model.grad_identity import summed_grad
from kempnerforge.model.mlp import SwiGLU
from kempnerforge.model.moe.experts import ExpertActivation, GroupedExperts
from kempnerforge.model.moe.tensor_split import local, router_input, shared_partial
from kempnerforge.model.moe.token_exchange import combine_tokens, dispatch_tokens


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
    """Token -> (experts, gate values): a linear map to one logit per expert, with a
    learned bias under model.moe_router_bias.

    The softmax router's renormalised top k (k > 1) is a softmax over the k chosen
    logits, since the softmax is monotonic and its normaliser cancels: the top-k then
    softmax of GPT-OSS's router."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.moe_router
        self.top_k = cfg.moe_top_k
        self.num_groups = cfg.moe_num_groups
        """model.moe_num_groups: expert groups of the group-limited sigmoid router."""
        self.top_groups = cfg.moe_top_groups
        """model.moe_top_groups: groups a token chooses its experts from."""
        self.routed_scaling = cfg.moe_routed_scaling
        """model.moe_routed_scaling: the gates' multiplier."""
        self.gate = nn.Linear(cfg.dim, cfg.num_experts, bias=cfg.moe_router_bias)
        """Router weights (experts, dim) and, under model.moe_router_bias, bias (experts,)."""
        self.expert_bias: torch.Tensor | None
        """Sigmoid router: per-expert fp32 offset added to the scores when choosing experts
        only; changed by update_expert_bias, never by the optimizer. Saved with the model."""
        bias = torch.zeros(cfg.num_experts) if self.kind == "sigmoid" else None
        self.register_buffer("expert_bias", bias, persistent=True)

    def forward(self, tokens: torch.Tensor) -> Routing:
        with torch.autocast(tokens.device.type, enabled=False):
            # Under tensor parallelism the weights are replicated DTensors: every rank
            # routes the whole tokens with all of them.
            bias = None if self.gate.bias is None else local(self.gate.bias).float()
            logits = F.linear(tokens.float(), local(self.gate.weight).float(), bias)
        if self.kind == "softmax":
            probs = torch.softmax(logits, dim=-1)
            gates, expert_ids = probs.topk(self.top_k, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            assert self.expert_bias is not None
            choice = self.group_limited(scores.detach() + self.expert_bias)
            _, expert_ids = choice.topk(self.top_k, dim=-1)
            gates = scores.gather(-1, expert_ids)
            probs = scores / scores.sum(-1, keepdim=True)
        if self.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        if self.routed_scaling != 1.0:
            gates = gates * self.routed_scaling
        return Routing(expert_ids, gates, probs, logits)

    def group_limited(self, choice: torch.Tensor) -> torch.Tensor:
        """The biased scores ``choice`` (T, E) with every expert outside the token's
        top_groups groups at -inf; each group ranked by the sum of its two best scores
        (DeepSeek-V3's rule). As it is with one group."""
        if self.num_groups == 1:
            return choice
        tokens, experts = choice.shape
        grouped = choice.view(tokens, self.num_groups, experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        kept = group_scores.topk(self.top_groups, dim=-1).indices
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)
        return grouped.masked_fill(~allowed[..., None], float("-inf")).view(tokens, experts)


class MoEFeedForward(nn.Module):
    """Routed experts (and shared ones) in place of a block's dense SwiGLU.

    ``ep_group`` (set by the parallelizer) is the process group the experts are split
    over, None when this rank holds every expert; ``balance_group`` the data-parallel
    group whose load counts the token-level balancing loss sums, so the loss is the one
    a single process would compute over the whole batch; ``sequence_split`` (context
    parallelism) the group each sequence is split over, for the sequence-level loss;
    ``tp_group`` the tensor-parallel group the experts' hidden features are split over
    (model/moe/tensor_split.py), None when this rank holds them whole.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_experts = cfg.num_experts
        self.top_k = cfg.moe_top_k
        self.capacity_factor = cfg.moe_capacity_factor
        self.aux_level = cfg.moe_aux_loss_level
        self.router = Router(cfg)
        """Chooses each token's experts."""
        self.experts = GroupedExperts(
            cfg.num_experts,
            cfg.dim,
            cfg.expert_hidden_dim,
            bias=cfg.moe_expert_bias,
            activation=ExpertActivation.of(cfg),
        )
        """The routed experts' stacked weights."""
        self.shared: SwiGLU | None = None
        """Shared experts (every token), as one SwiGLU of moe_shared_experts times the
        expert width: the same function as that many experts summed."""
        if cfg.moe_shared_experts:
            self.shared = SwiGLU(cfg.dim, cfg.moe_shared_experts * cfg.expert_hidden_dim)
        self.ep_group: dist.ProcessGroup | None = None
        self.balance_group: dist.ProcessGroup | None = None
        self.tp_group: dist.ProcessGroup | None = None
        self.sequence_split: SequenceSplit | None = None
        """Under context parallelism: the group each sequence is split over, whose
        per-sequence expert counts the sequence-level balancing loss sums."""
        self.last: RouterStats | None = None
        """The latest forward's losses and counts."""
        self.totals: StepTotals | None = None
        """This step's sums of ``last`` over micro-batches (record_router_stats)."""
        self.step = 0
        """The optimizer step being taken (begin_router_step), for the bias schedule."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)
        routing = self.router(router_input(tokens, self.tp_group))
        flat_ids = routing.expert_ids.reshape(-1)  # assignment q = token * k + slot
        load = _expert_counts(flat_ids, self.num_experts)
        keep = self._within_capacity(routing.expert_ids)
        out = self._run_experts(tokens, routing, flat_ids, load, keep)
        if self.shared is not None:
            out = out + self._shared_output(tokens)
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
            out = out + self._shared_output(tokens)
        return out.reshape(batch, seq, -1)

    def _shared_output(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared experts' output: whole, or this rank's partial sum under tensor
        parallelism."""
        assert self.shared is not None
        if self.tp_group is None:
            return self.shared(tokens)
        return shared_partial(self.shared, tokens)

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
        # Under tensor parallelism out_rows are this rank's partial sums (tensor_split.py).
        gates = summed_grad(routing.gates, self.tp_group).reshape(-1)[order]
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
        Sequence level: f and P per sequence, averaged over sequences; under context
        parallelism (in training) f counts the whole sequence, summed over the cp group
        in one all-reduce, and P this rank's slice of it.
        """
        experts, k = self.num_experts, self.top_k
        if self.aux_level == "sequence":
            one_hot = F.one_hot(routing.expert_ids.reshape(batch, seq * k), experts)
            counts = one_hot.sum(1).float()  # (batch, E), no gradient
            split = active_split(self)
            if split is not None and self.training and torch.is_grad_enabled():
                # This rank holds a slice of each sequence: f is the whole sequence's.
                dist.all_reduce(counts, group=split.group)
            share = counts / counts.sum(-1, keepdim=True)
            # P over this rank's positions: the loss is linear in P, so the mean of the
            # context-parallel ranks' losses (their gradients are averaged) is the
            # whole sequence's, and P needs no exchange.
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
