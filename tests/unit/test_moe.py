"""Mixture-of-Experts: routers, the MoE feed-forward against per-token references, grouped
expert compute, capacity drops, balancing, the step bookkeeping and the config rules."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.cli import main
from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model.mlp import SwiGLU
from kempnerforge.model.moe.experts import ExpertActivation, grouped_swiglu, looped_swiglu
from kempnerforge.model.moe.layer import MoEFeedForward, moe_layers
from kempnerforge.model.moe.router_step import (
    add_micro_batch_router_losses,
    add_router_losses,
    begin_router_step,
    bias_rate_factor,
    finish_router_step,
    record_router_stats,
    update_expert_bias,
)
from kempnerforge.model.transformer import Transformer, flops_per_token
from kempnerforge.optim.optimizer import build_optimizer
from kempnerforge.training.loop import add_moe_losses
from tests.support.tolerance import (
    assert_reordered_close,
    reorder_atol,
    transformer_terms,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
VOCAB = 64
DIM = 16
ROUTERS = ("softmax", "sigmoid")


MOE_FIELDS: dict = dict(n_heads=2, vocab_size=VOCAB, multiple_of=16, num_experts=4, moe_top_k=2)
"""What the layer and the model configs share: 2 heads, 4 experts, 2 of them a token."""


def layer_config(**overrides: object) -> ModelConfig:
    """One-block config whose MoE layer is 4 experts of width 8 over a 16-wide stream."""
    shape = dict(dim=DIM, n_layers=1, max_seq_len=32, moe_expert_hidden_dim=8)
    return ModelConfig(**{**MOE_FIELDS, **shape, **overrides})


def moe_layer(seed: int = 0, **overrides: object) -> MoEFeedForward:
    """An MoEFeedForward with every parameter drawn from normal(0, 0.3) by ``seed``."""
    layer = MoEFeedForward(layer_config(**overrides))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return layer


def model_config(**overrides: object) -> ModelConfig:
    """Two-block config of 4 experts of width 16 over a 32-wide stream, 16 positions."""
    shape = dict(dim=32, n_layers=2, max_seq_len=16, moe_expert_hidden_dim=16)
    return ModelConfig(**{**MOE_FIELDS, **shape, **overrides})


def moe_model(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(model_config(**overrides))


def random_tokens(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def random_ids(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def identity_gate(layer: MoEFeedForward) -> None:
    """Make router logit e equal to channel e of the token (e < num_experts)."""
    experts = layer.num_experts
    with torch.no_grad():
        layer.router.gate.weight.zero_()
        layer.router.gate.weight[:, :experts] = torch.eye(experts)


def routed_tokens(choices: list[list[int]], experts: int, seed: int = 2) -> torch.Tensor:
    """(1, T, DIM) tokens that an identity gate sends to ``choices[t]``, best first: logit 3
    for the first choice, 2 for the second, 0 for the rest; channels >= experts random."""
    x = random_tokens((1, len(choices), DIM), seed)
    x[0, :, :experts] = 0.0
    for t, chosen in enumerate(choices):
        for rank, expert in enumerate(chosen):
            x[0, t, expert] = 3.0 - rank
    return x


def reference_routing(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    kind: str,
    top_k: int,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, by hand: the top_k experts by probability (softmax) or by score + bias
    (sigmoid), and their unbiased values renormalised over the chosen (raw when k = 1)."""
    ids, gates = [], []
    for token in tokens:
        logits = weight @ token
        if kind == "softmax":
            exp = (logits - logits.max()).exp()
            scores = exp / exp.sum()
            rank_by = scores.detach()
        else:
            scores = 1.0 / (1.0 + (-logits).exp())
            rank_by = scores.detach() + (0.0 if bias is None else bias)
        chosen = sorted(range(len(scores)), key=lambda e: -float(rank_by[e]))[:top_k]
        picked = scores[chosen]
        if top_k > 1:
            picked = picked / picked.sum()
        ids.append(chosen)
        gates.append(picked)
    return torch.tensor(ids), torch.stack(gates)


def reference_moe(
    layer: MoEFeedForward,
    x: torch.Tensor,
    kept: list[list[bool]] | None = None,
) -> torch.Tensor:
    """The layer's output computed token by token: each chosen (and kept) expert's SwiGLU
    weighted by its gate, summed, plus the shared experts."""
    batch, seq, dim = x.shape
    tokens = x.reshape(-1, dim)
    bias = layer.router.expert_bias
    ids, gates = reference_routing(
        tokens, layer.router.gate.weight, layer.router.kind, layer.top_k, bias
    )
    w1, w3, w2 = layer.experts.w1, layer.experts.w3, layer.experts.w2
    rows = []
    for t, token in enumerate(tokens):
        out = torch.zeros_like(token)
        for slot in range(layer.top_k):
            if kept is not None and not kept[t][slot]:
                continue
            e = int(ids[t, slot])
            hidden = F.silu(token @ w1[e]) * (token @ w3[e])
            out = out + gates[t, slot] * (hidden @ w2[e])
        if layer.shared is not None:
            out = out + layer.shared(token)
        rows.append(out)
    return torch.stack(rows).reshape(batch, seq, dim)


def routing_atol(tokens: torch.Tensor, weight: torch.Tensor, top_k: int) -> float:
    """How far two fp32 routers' gates and probabilities can differ: a logit sums DIM
    products (|tokens| @ |weight|.T bounds their sum of magnitudes), a softmax or a sigmoid
    moves a probability by at most twice its logit's error, and the softmax's sum (4
    experts) and the renormalisation (top_k) sum terms of at most 1."""
    scale = (tokens.abs() @ weight.abs().T).max().item()
    return 2 * reorder_atol(torch.float32, DIM, scale) + reorder_atol(torch.float32, 4 + top_k, 1.0)


def expert_terms(hidden: int, *, grads: bool) -> int:
    """The sizes summed along an expert SwiGLU's longest chain: DIM into the hidden and
    ``hidden`` into the output; the backward adds DIM into the hidden's gradient and
    ``hidden`` twice (through w1 and w3) into the rows' gradient."""
    forward = DIM + hidden
    return forward + DIM + 2 * hidden if grads else forward


def moe_terms(layer: MoEFeedForward, *, grads: bool) -> int:
    """An MoE layer's chain: the router's logits (DIM), softmax (4) and renormalisation
    (top_k) in front of the widest expert (routed or shared), then top_k outputs and the
    shared one summed per token."""
    widest = layer.experts.w1.shape[-1]
    if layer.shared is not None:
        widest = max(widest, layer.shared.w1.weight.shape[0])
    return DIM + 4 + layer.top_k + expert_terms(widest, grads=grads) + layer.top_k + 1


def imbalance(load: torch.Tensor) -> float:
    return float(load.max() / load.mean())


# --- Routers ----------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_softmax_router_is_softmax_topk_renormalised(top_k: int) -> None:
    layer = moe_layer(moe_top_k=top_k)
    tokens = random_tokens((12, DIM))
    routing = layer.router(tokens)
    ids, gates = reference_routing(tokens, layer.router.gate.weight, "softmax", top_k)
    # The choices are compared exactly: their margins are far above rounding here.
    assert torch.equal(routing.expert_ids, ids)
    # The router's batched logits and the per-token reference sum in different orders.
    atol = routing_atol(tokens, layer.router.gate.weight, top_k)
    torch.testing.assert_close(routing.gates, gates, atol=atol, rtol=0)
    probs = torch.softmax(tokens @ layer.router.gate.weight.T, dim=-1)
    torch.testing.assert_close(routing.probs, probs, atol=atol, rtol=0)
    if top_k == 1:
        # The raw probability, not 1.0: the gate must stay a function of the router weights.
        torch.testing.assert_close(routing.gates[:, 0], probs.max(-1).values, atol=atol, rtol=0)
        assert bool((routing.gates < 1.0).all())
    else:
        # Renormalised gates of at most 1 each, summed again: top_k roundings per sum.
        atol = reorder_atol(torch.float32, 2 * top_k, 1.0)
        torch.testing.assert_close(routing.gates.sum(-1), torch.ones(12), atol=atol, rtol=0)


def test_sigmoid_router_chooses_on_score_plus_bias_and_gates_on_the_score() -> None:
    layer = moe_layer(moe_router="sigmoid")
    identity_gate(layer)
    tokens = routed_tokens([[0, 1]] * 3, experts=4)[0]
    routing = layer.router(tokens)
    assert routing.expert_ids.tolist() == [[0, 1]] * 3
    # sigmoid(0) + 1 = 1.5 beats sigmoid(3) = 0.95: the bias alone moves expert 2 in front.
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.0]))
    routing = layer.router(tokens)
    assert routing.expert_ids.tolist() == [[2, 0]] * 3
    scores = torch.sigmoid(torch.tensor([0.0, 3.0]))
    # The identity gate's logits are exact, but the router's sigmoid and normalisation run
    # on a (3, 4) block and these on two numbers: vectorised and scalar kernels.
    atol = routing_atol(tokens, layer.router.gate.weight, 2)
    torch.testing.assert_close(
        routing.gates, (scores / scores.sum()).expand(3, 2), atol=atol, rtol=0
    )
    ids, gates = reference_routing(
        tokens, layer.router.gate.weight, "sigmoid", 2, layer.router.expert_bias
    )
    assert torch.equal(routing.expert_ids, ids)
    torch.testing.assert_close(routing.gates, gates, atol=atol, rtol=0)
    # The routing distribution (for the balancing loss) is the unbiased scores normalised.
    all_scores = torch.sigmoid(tokens[:, :4])
    want = all_scores / all_scores.sum(-1, keepdim=True)
    torch.testing.assert_close(routing.probs, want, atol=atol, rtol=0)


def test_sigmoid_router_with_one_expert_keeps_the_raw_score() -> None:
    layer = moe_layer(moe_router="sigmoid", moe_top_k=1)
    identity_gate(layer)
    layer.router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1.0, 0.0]))
    routing = layer.router(routed_tokens([[0, 1], [1, 3]], experts=4)[0])
    assert routing.expert_ids.tolist() == [[2], [2]]
    torch.testing.assert_close(routing.gates, torch.full((2, 1), 0.5))  # sigmoid(0)


@pytest.mark.parametrize("router", ROUTERS)
def test_router_math_is_fp32_under_bf16_autocast(router: str) -> None:
    layer = moe_layer(moe_router=router)
    tokens = random_tokens((12, DIM))
    expected = layer.router(tokens)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = layer.router(tokens)
        out = layer(tokens.reshape(2, 6, DIM))
    # The router leaves autocast and runs fp32: the same kernels on the same inputs, exact.
    for name in ("gates", "probs", "logits"):
        assert getattr(routing, name).dtype == torch.float32, name
        assert torch.equal(getattr(routing, name), getattr(expected, name)), name
    assert torch.equal(routing.expert_ids, expected.expert_ids)
    assert out.dtype == torch.bfloat16  # the experts do run in the autocast dtype
    assert layer.last.aux_loss.dtype == torch.float32
    assert layer.last.z_loss.dtype == torch.float32


# --- The MoE feed-forward against a per-token reference ---------------------------------


@pytest.mark.parametrize("compute", ["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("router", ROUTERS)
def test_moe_output_and_grads_match_the_per_token_reference(
    router: str, top_k: int, shared: int, compute: str
) -> None:
    layer = moe_layer(moe_router=router, moe_top_k=top_k, moe_shared_experts=shared)
    layer.experts.compute = compute
    if router == "sigmoid":
        layer.router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))
    x = random_tokens((2, 6, DIM)).requires_grad_()
    upstream = random_tokens((2, 6, DIM), seed=5)
    weights = [layer.experts.w1, layer.experts.w3, layer.experts.w2, layer.router.gate.weight]
    if layer.shared is not None:
        weights.append(layer.shared.w1.weight)

    out = layer(x)
    expected = reference_moe(layer, x)
    # The layer's grouped kernels and the per-token reference sum in different orders.
    assert_reordered_close(out, expected, terms=moe_terms(layer, grads=False))

    grads = torch.autograd.grad((out * upstream).sum(), [x, *weights])
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [x, *weights])
    for got, want in zip(grads, expected_grads, strict=True):
        assert want.abs().sum() > 0
        assert_reordered_close(got, want, terms=moe_terms(layer, grads=True))


# --- Grouped expert compute -------------------------------------------------------------


def expert_weights(experts: int, hidden: int, seed: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = [(experts, DIM, hidden), (experts, DIM, hidden), (experts, hidden, DIM)]
    return [(torch.randn(s, generator=gen) * 0.3).requires_grad_() for s in shapes]


@pytest.mark.parametrize("compute", ["grouped_mm", "padded_bmm", "auto"])
def test_grouped_swiglu_matches_the_per_expert_loop_with_uneven_groups(compute: str) -> None:
    counts = torch.tensor([3, 0, 5, 1])  # expert 1 gets no row
    rows = random_tokens((9, DIM)).requires_grad_()
    weights = expert_weights(4, 8)
    upstream = random_tokens((9, DIM), seed=4)

    out = grouped_swiglu(rows, counts, *weights, compute)
    expected = looped_swiglu(rows, counts, *weights)
    # Grouped, padded and looped matmuls sum in kernel-chosen orders.
    assert_reordered_close(out, expected, terms=expert_terms(8, grads=False))

    grads = torch.autograd.grad((out * upstream).sum(), [rows, *weights])
    expected_grads = torch.autograd.grad((expected * upstream).sum(), [rows, *weights])
    for got, want in zip(grads, expected_grads, strict=True):
        assert_reordered_close(got, want, terms=expert_terms(8, grads=True))
    for weight_grad in grads[1:]:  # the idle expert's slices get an exact zero gradient
        assert weight_grad[1].abs().sum() == 0
        assert weight_grad[0].abs().sum() > 0


@pytest.mark.parametrize("compute", ["grouped_mm", "padded_bmm", "auto"])
def test_biased_clamped_experts_match_the_loop_and_dropped_rows_stay_zero(compute: str) -> None:
    """GPT-OSS's experts (model.moe_expert_bias, 'clamped_swiglu' with a clamp that binds)
    in every compute path: each row gets its own expert's biases, and the two rows past
    the groups (a capacity limit's drops) stay zero and give the biases no gradient."""
    counts = torch.tensor([3, 0, 5, 1])
    rows = random_tokens((11, DIM)).requires_grad_()
    weights = expert_weights(4, 8)
    gen = torch.Generator().manual_seed(5)
    shapes = [(4, 8), (4, 8), (4, DIM)]
    biases = [(torch.randn(s, generator=gen) * 0.3).requires_grad_() for s in shapes]
    activation = ExpertActivation("clamped_swiglu", limit=0.3, alpha=1.702)
    upstream = random_tokens((11, DIM), seed=4)

    out = grouped_swiglu(
        rows, counts, *weights, compute, biases=tuple(biases), activation=activation
    )
    assert out[9:].abs().sum() == 0
    expected = looped_swiglu(
        rows[:9], counts, *weights, biases=tuple(biases), activation=activation
    )
    assert_reordered_close(out[:9], expected, terms=expert_terms(8, grads=False) + 2)
    inputs = [rows, *weights, *biases]
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * upstream[:9]).sum(), inputs)
    for got, want in zip(grads, expected_grads, strict=True):
        assert_reordered_close(got, want, terms=expert_terms(8, grads=True) + 4)
    for bias_grad in grads[4:]:  # the idle expert's biases get an exact zero gradient
        assert bias_grad[1].abs().sum() == 0 and bias_grad[0].abs().sum() > 0


@pytest.mark.parametrize("compute", ["grouped_mm", "padded_bmm"])
def test_grouped_swiglu_in_bf16_autocast_is_close_to_fp32(compute: str) -> None:
    counts = torch.tensor([4, 0, 7, 5])
    rows = random_tokens((16, DIM))
    weights = [w.detach() for w in expert_weights(4, 16)]
    expected = looped_swiglu(rows, counts, *weights)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = grouped_swiglu(rows, counts, *weights, compute)
    assert out.dtype == torch.bfloat16
    # bf16 keeps 8 bits of mantissa: a relative error near 2**-8, far below the ~0.6 that
    # sending rows to the wrong expert gives here.
    error = (out.float() - expected).norm() / expected.norm()
    assert 0 < error < 1.5e-2


@pytest.mark.parametrize("compute", ["grouped_mm", "padded_bmm"])
def test_grouped_swiglu_with_no_rows_returns_empty_and_zero_grads(compute: str) -> None:
    rows = torch.zeros(0, DIM, requires_grad=True)
    weights = expert_weights(4, 8)
    out = grouped_swiglu(rows, torch.zeros(4, dtype=torch.int64), *weights, compute)
    assert out.shape == (0, DIM)
    out.sum().backward()
    for weight in weights:
        assert weight.grad is not None
        assert weight.grad.shape == weight.shape
        assert weight.grad.abs().sum() == 0


# --- Capacity ---------------------------------------------------------------------------


def kept_by_capacity(choices: list[list[int]], experts: int, capacity: int) -> list[list[bool]]:
    """Which assignments fit: every first choice before any second, earlier tokens first."""
    used = [0] * experts
    kept = [[False] * len(c) for c in choices]
    for slot in range(len(choices[0])):
        for t, chosen in enumerate(choices):
            expert = chosen[slot]
            if used[expert] < capacity:
                used[expert] += 1
                kept[t][slot] = True
    return kept


def test_capacity_keeps_first_choices_first_and_zeroes_fully_dropped_tokens() -> None:
    cfg = layer_config(moe_capacity_factor=1.0)
    layer = moe_layer(moe_capacity_factor=1.0)
    identity_gate(layer)
    # 8 tokens, all to experts 0 then 1: capacity ceil(1.0 * 8 * 2 / 4) = 4 per expert, so
    # tokens 0-3 keep both assignments and tokens 4-7 lose both.
    x = routed_tokens([[0, 1]] * 8, experts=4)
    out = layer(x)
    assert layer.last.dropped.item() == 8
    assert layer.last.load.tolist() == [8, 8, 0, 0]  # counted before the drop
    assert torch.equal(out[0, 4:], torch.zeros(4, DIM))
    kept = [[True, True]] * 4 + [[False, False]] * 4
    # Grouped kernels against the per-token reference: different summation orders.
    assert_reordered_close(out, reference_moe(layer, x, kept), terms=moe_terms(layer, grads=False))
    assert out[0, :4].abs().sum() > 0

    begin_router_step(layer, 0)
    record_router_stats(layer)
    row = finish_router_step(layer, cfg, None, max_steps=10, with_metrics=True)
    assert row is not None
    assert row["moe/dropped_share"] == 0.5
    assert row["moe/load"] == [[8, 8, 0, 0]]


def test_capacity_gives_second_choices_only_what_first_choices_left() -> None:
    # Capacity ceil(1.0 * 4 * 2 / 4) = 2. Tokens 0 and 1 fill expert 1 with first choices,
    # tokens 2 and 3 fill expert 0 with theirs, so tokens 0 and 1 lose their second choice
    # (expert 0) although they come first: a token-order rule would drop 2 and 3 instead.
    layer = moe_layer(moe_capacity_factor=1.0)
    identity_gate(layer)
    choices = [[1, 0], [1, 0], [0, 2], [0, 3]]
    x = routed_tokens(choices, experts=4)
    out = layer(x)
    kept = [[True, False], [True, False], [True, True], [True, True]]
    assert kept_by_capacity(choices, 4, 2) == kept
    assert layer.last.dropped.item() == 2
    # Grouped kernels against the per-token reference: different summation orders.
    assert_reordered_close(out, reference_moe(layer, x, kept), terms=moe_terms(layer, grads=False))


@pytest.mark.parametrize(("factor", "top_k"), [(0.5, 1), (0.75, 2), (1.25, 2)])
def test_dropped_assignments_equal_the_hand_count(factor: float, top_k: int) -> None:
    gen = torch.Generator().manual_seed(7)
    tokens, experts = 24, 4
    choices = [torch.randperm(experts, generator=gen)[:top_k].tolist() for _ in range(tokens)]
    # Skew the load so the limit bites: half the tokens send their first choice to expert 0.
    for chosen in choices[::2]:
        if 0 in chosen:
            chosen.remove(0)
        chosen.insert(0, 0)
        del chosen[top_k:]
    cfg = layer_config(moe_capacity_factor=factor, moe_top_k=top_k)
    layer = moe_layer(moe_capacity_factor=factor, moe_top_k=top_k)
    identity_gate(layer)
    x = routed_tokens(choices, experts)
    out = layer(x)

    capacity = math.ceil(factor * tokens * top_k / experts)
    kept = kept_by_capacity(choices, experts, capacity)
    dropped = sum(not k for row in kept for k in row)
    assert dropped > 0
    assert layer.last.dropped.item() == dropped
    # Grouped kernels against the per-token reference: different summation orders.
    assert_reordered_close(out, reference_moe(layer, x, kept), terms=moe_terms(layer, grads=False))
    for t, row in enumerate(kept):
        if not any(row):
            assert torch.equal(out[0, t], torch.zeros(DIM))

    begin_router_step(layer, 0)
    record_router_stats(layer)
    row = finish_router_step(layer, cfg, None, max_steps=10, with_metrics=True)
    assert row is not None
    assert row["moe/dropped_share"] == pytest.approx(dropped / (tokens * top_k))


# --- Balancing --------------------------------------------------------------------------


def skewed_layer(router: str, **overrides: object) -> MoEFeedForward:
    """8 experts, top 2, and a router that sends nearly every token to expert 0: the tokens
    share a +2 offset on channel 0, which only expert 0's gate row reads strongly."""
    layer = moe_layer(moe_router=router, num_experts=8, **overrides)
    with torch.no_grad():
        layer.router.gate.weight[0, 0] = 3.0
    return layer


def offset_tokens(gen: torch.Generator, tokens: int = 64) -> torch.Tensor:
    x = torch.randn(1, tokens, DIM, generator=gen)
    x[..., 0] += 2.0
    return x


def test_aux_loss_balances_a_skewed_softmax_router() -> None:
    cfg = layer_config(num_experts=8, moe_aux_loss_weight=1.0, moe_router_z_loss_weight=0.0)
    layer = skewed_layer("softmax")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer(offset_tokens(gen, 512))
    before = imbalance(layer.last.load)
    assert before > 3.0

    optimizer = torch.optim.SGD([layer.router.gate.weight], lr=0.5)
    for _ in range(60):
        layer(offset_tokens(gen))
        loss = add_moe_losses(torch.zeros(()), layer, cfg)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        layer(offset_tokens(gen, 512))
    assert imbalance(layer.last.load) < 1.5
    assert layer.last.aux_loss.item() < 1.1  # 1.0 is perfectly even


def test_bias_updates_balance_a_skewed_sigmoid_router_without_an_optimizer() -> None:
    cfg = layer_config(num_experts=8, moe_router="sigmoid", moe_bias_update_rate=0.02)
    layer = skewed_layer("sigmoid")
    gate_before = layer.router.gate.weight.detach().clone()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        layer(offset_tokens(gen, 512))
    start_load = layer.last.load.clone()
    assert imbalance(start_load) > 3.0

    for step in range(100):
        begin_router_step(layer, step)
        with torch.no_grad():
            layer(offset_tokens(gen))
        record_router_stats(layer)
        finish_router_step(layer, cfg, None, max_steps=100, with_metrics=False)
    with torch.no_grad():
        layer(offset_tokens(gen, 512))
    assert imbalance(layer.last.load) < 1.5
    bias = layer.router.expert_bias
    assert bias[0] < 0 and int(bias.argmin()) == 0  # the overused expert was pushed down
    underused = start_load < start_load.mean()
    assert bool((bias[underused] > 0).all())
    assert torch.equal(layer.router.gate.weight, gate_before)


# --- Router losses, the balancing bias and the optimizer --------------------------------


@pytest.mark.parametrize("router", ROUTERS)
def test_aux_and_z_losses_each_reach_the_router_weights(router: str) -> None:
    layer = moe_layer(moe_router=router)
    layer(random_tokens((2, 6, DIM)))
    weight = layer.router.gate.weight
    (aux_grad,) = torch.autograd.grad(layer.last.aux_loss, weight, retain_graph=True)
    (z_grad,) = torch.autograd.grad(layer.last.z_loss, weight)
    assert aux_grad.abs().sum() > 0
    assert z_grad.abs().sum() > 0


@pytest.mark.parametrize("router", ROUTERS)
def test_aux_and_z_losses_follow_their_formulas(router: str) -> None:
    layer = moe_layer(moe_router=router, moe_aux_loss_level="token")
    x = random_tokens((2, 6, DIM))
    layer(x)
    routing = layer.router(x.reshape(-1, DIM))
    share = F.one_hot(routing.expert_ids.reshape(-1), 4).sum(0).float() / (12 * 2)
    expected_aux = 4 * (share * routing.probs.mean(0)).sum()
    # The layer's load counts and means run other kernels than this formula: a mean over
    # 12 tokens and a sum over 4 experts of positive terms, in other orders.
    assert_reordered_close(layer.last.aux_loss, expected_aux, terms=12 + 4)
    expected_z = torch.logsumexp(routing.logits, -1).square().mean()
    # Exact: the same router on the same tokens, then the layer's own z formula.
    assert torch.equal(layer.last.z_loss, expected_z)

    layer.aux_level = "sequence"
    layer(x)
    per_sequence = []
    for b in range(2):
        ids = routing.expert_ids.reshape(2, 12)[b]
        seq_share = F.one_hot(ids, 4).sum(0).float() / 12
        per_sequence.append(4 * (seq_share * routing.probs.reshape(2, 6, 4)[b].mean(0)).sum())
    # A mean over 6 tokens, a sum over 4 experts and a mean over 2 sequences, reordered.
    assert_reordered_close(layer.last.aux_loss, torch.stack(per_sequence).mean(), terms=6 + 4 + 2)


def test_expert_bias_is_a_saved_buffer_that_only_the_balancing_rule_changes() -> None:
    model = moe_model(moe_router="sigmoid")
    router = model.layers["0"].feed_forward.router
    bias = router.expert_bias
    assert not bias.requires_grad
    assert all(p is not bias for p in model.parameters())
    assert "layers.0.feed_forward.router.expert_bias" in model.state_dict()
    assert "layers.1.feed_forward.router.expert_bias" in model.state_dict()

    optimizer = build_optimizer(model, OptimizerConfig(lr=0.1, weight_decay=0.5))
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert in_optimizer == {id(p) for p in model.parameters()}
    assert id(bias) not in in_optimizer

    bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    before = bias.clone()
    gate_before = router.gate.weight.detach().clone()
    mc = model.cfg
    loss = add_moe_losses(model(random_ids()).float().square().mean(), model, mc)
    loss.backward()
    optimizer.step()
    assert torch.equal(bias, before)
    assert not torch.equal(router.gate.weight, gate_before)  # the step did step

    update_expert_bias(router, torch.tensor([4.0, 0.0, 2.0, 2.0]), 0.01)
    # One rounded addition each way (add_ with alpha here): one rounding apart at most.
    assert_reordered_close(bias, before + torch.tensor([-0.01, 0.01, 0.0, 0.0]), terms=1)


def test_meta_build_then_init_weights_equals_direct_build_with_a_zero_expert_bias() -> None:
    torch.manual_seed(0)
    reference = Transformer(model_config(moe_router="sigmoid", moe_shared_experts=1))
    with torch.device("meta"):
        model = Transformer(model_config(moe_router="sigmoid", moe_shared_experts=1))
    model.to_empty(device="cpu")
    for layer in moe_layers(model):
        layer.router.expert_bias.fill_(7.0)  # what to_empty left behind, made visible
    torch.manual_seed(0)
    model.init_weights()
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    for layer in moe_layers(model):
        assert torch.equal(layer.router.expert_bias, torch.zeros(4))


def test_softmax_router_has_no_expert_bias() -> None:
    model = moe_model(moe_router="softmax")
    router = model.layers["0"].feed_forward.router
    assert router.expert_bias is None
    assert not any("expert_bias" in key for key in model.state_dict())
    update_expert_bias(router, torch.tensor([4.0, 0.0, 2.0, 2.0]), 0.01)  # does nothing


# --- add_moe_losses ---------------------------------------------------------------------


@pytest.mark.parametrize("frequency", [1, 2])
def test_add_moe_losses_adds_weighted_sums_over_the_moe_blocks(frequency: int) -> None:
    mc = model_config(
        moe_frequency=frequency, moe_aux_loss_weight=0.1, moe_router_z_loss_weight=0.01
    )
    model = moe_model(
        moe_frequency=frequency, moe_aux_loss_weight=0.1, moe_router_z_loss_weight=0.01
    )
    model(random_ids())
    blocks = [model.layers[str(i)].feed_forward for i in range(2)]
    moe_blocks = [b for b in blocks if isinstance(b, MoEFeedForward)]
    assert len(moe_blocks) == (2 if frequency == 1 else 1)
    if frequency == 2:
        assert isinstance(blocks[0], SwiGLU)
    assert moe_layers(model) == moe_blocks

    base = torch.tensor(2.5)
    total = add_moe_losses(base, model, mc)
    aux = sum(b.last.aux_loss for b in moe_blocks)
    z = sum(b.last.z_loss for b in moe_blocks)
    # Stacked sums against Python's left-to-right one: 2 blocks of 2 positive terms and
    # the base, in another order.
    assert_reordered_close(total, base + 0.1 * aux + 0.01 * z, terms=5)
    assert total > base

    zero = model_config(moe_aux_loss_weight=0.0, moe_router_z_loss_weight=0.0)
    assert add_moe_losses(base, model, zero) is base


def test_add_moe_losses_does_not_walk_the_modules_again(monkeypatch) -> None:
    mc = model_config(moe_router_z_loss_weight=0.01)
    model = moe_model(moe_router_z_loss_weight=0.01)
    model(random_ids())
    first = add_moe_losses(torch.tensor(1.0), model, mc)

    def walked(*args, **kwargs):
        raise AssertionError("add_moe_losses walked the model's modules again")

    for name in ("modules", "named_modules", "children", "named_children"):
        monkeypatch.setattr(model, name, walked)
    model(random_ids())
    # Exact: the same forward on the same ids, then the same sums.
    assert torch.equal(add_moe_losses(torch.tensor(1.0), model, mc), first)


def test_a_micro_batch_adds_its_share_of_the_router_terms() -> None:
    mc = model_config(moe_aux_loss_weight=0.1, moe_router_z_loss_weight=0.01)
    model = moe_model(moe_aux_loss_weight=0.1, moe_router_z_loss_weight=0.01)
    model(random_ids())
    objective = torch.tensor(0.75)
    terms = add_router_losses(torch.tensor(0.0), model, mc)
    assert terms > 0
    share = add_micro_batch_router_losses(objective, model, mc, 4)
    # (objective * 4 + terms) / 4 against objective + terms / 4: three positive terms,
    # rounded in another order.
    assert_reordered_close(share, objective + terms / 4, terms=3)


def test_the_router_step_functions_leave_a_dense_model_alone() -> None:
    """The step bodies and the loop call them on every model: a dense one gets its
    objective back as it was (the same tensor, not rescaled), and no router step."""
    mc = model_config(num_experts=0)
    model = Transformer(mc)
    model(random_ids())
    assert moe_layers(model) == []
    objective = torch.tensor(1.0 / 3.0, requires_grad=True)
    assert add_router_losses(objective, model, mc) is objective
    assert add_micro_batch_router_losses(objective, model, mc, 3) is objective
    begin_router_step(model, 5)
    record_router_stats(model)
    assert finish_router_step(model, mc, None, max_steps=10, with_metrics=True) is None


# --- Step bookkeeping: bias schedules and the sign rule ---------------------------------


@pytest.mark.parametrize(
    ("schedule", "step", "factor"),
    [
        ("constant", 0, 1.0),
        ("constant", 999, 1.0),
        ("linear_warmup", 0, 0.1),  # (step + 1) / (0.1 * 100)
        ("linear_warmup", 4, 0.5),
        ("linear_warmup", 9, 1.0),
        ("linear_warmup", 60, 1.0),
        ("cosine_decay", 0, 1.0),
        ("cosine_decay", 25, 0.5 * (1 + math.cos(math.pi / 4))),
        ("cosine_decay", 50, 0.5),
        ("cosine_decay", 100, 0.0),
        ("cosine_decay", 150, 0.0),
    ],
)
def test_bias_rate_factor(schedule: str, step: int, factor: float) -> None:
    assert bias_rate_factor(schedule, step, 100) == pytest.approx(factor, abs=1e-12)


@pytest.mark.parametrize(
    ("schedule", "step", "factor"), [("constant", 3, 1.0), ("linear_warmup", 4, 0.5)]
)
def test_finish_router_step_moves_each_bias_by_rate_times_sign(
    schedule: str, step: int, factor: float
) -> None:
    rate = 0.04
    cfg = layer_config(
        moe_router="sigmoid", moe_top_k=1, moe_bias_update_rate=rate, moe_bias_schedule=schedule
    )
    layer = moe_layer(moe_router="sigmoid", moe_top_k=1)
    identity_gate(layer)
    begin_router_step(layer, step)
    # Two micro-batches: loads [2, 1, 1, 0] then [2, 1, 1, 0], mean 1 per micro-batch.
    for _ in range(2):
        with torch.no_grad():
            layer(routed_tokens([[0], [0], [1], [2]], experts=4))
        record_router_stats(layer)
    assert layer.totals.load.tolist() == [4, 2, 2, 0]
    row = finish_router_step(layer, cfg, None, max_steps=100, with_metrics=True)
    step_rate = torch.tensor(rate * factor, dtype=torch.float32)
    expected = torch.stack([-step_rate, torch.tensor(0.0), torch.tensor(0.0), step_rate])
    assert torch.equal(layer.router.expert_bias, expected)
    assert row is not None
    assert row["moe/load"] == [[4, 2, 2, 0]]
    assert row["moe/imbalance"] == 2.0
    assert row["moe/dropped_share"] == 0.0


def test_finish_router_step_leaves_a_softmax_router_alone_and_skips_quiet_steps() -> None:
    cfg = layer_config()
    layer = moe_layer()
    begin_router_step(layer, 0)
    layer(random_tokens((2, 6, DIM)))
    record_router_stats(layer)
    assert finish_router_step(layer, cfg, None, max_steps=10, with_metrics=False) is None
    row = finish_router_step(layer, cfg, None, max_steps=10, with_metrics=True)
    assert row is not None
    assert row["moe/aux_loss"] == pytest.approx(layer.last.aux_loss.item())
    assert row["moe/z_loss"] == pytest.approx(layer.last.z_loss.item())
    assert sum(row["moe/load"][0]) == 12 * 2


# --- Parameter and FLOP accounting ------------------------------------------------------


def test_flops_per_token_counts_the_active_experts_only() -> None:
    dense = ModelConfig(
        dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, max_seq_len=32, ffn_hidden_dim=128
    )
    # Top 2 of 8 experts, each half the dense width: the same expert FLOPs as the dense
    # SwiGLU, plus the router's dim x num_experts matrix in each block.
    moe = ModelConfig(
        dim=64,
        n_layers=2,
        n_heads=4,
        vocab_size=VOCAB,
        max_seq_len=32,
        ffn_hidden_dim=128,
        num_experts=8,
        moe_top_k=2,
        moe_expert_hidden_dim=64,
    )
    router_flops = 6.0 * 2 * 64 * 8
    assert flops_per_token(moe, 16) == flops_per_token(dense, 16) + router_flops
    torch.manual_seed(0)
    assert Transformer(moe).flops_per_token(16) == flops_per_token(moe, 16)
    assert moe.num_params() - moe.num_active_params() == 2 * 6 * 3 * 64 * 64  # idle experts


# --- Config rules -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"moe_top_k": 5}, "model.moe_top_k = 5: expected <= model.num_experts = 4"),
        ({"moe_capacity_factor": 0}, "model.moe_capacity_factor = 0: expected an integer > 0"),
        ({"moe_capacity_factor": -1.0}, "model.moe_capacity_factor = -1.0: expected a number > 0"),
        (
            {"moe_router": "foo"},
            "model.moe_router = 'foo': expected one of 'softmax', 'sigmoid'",
        ),
        ({"moe_frequency": 3}, "model.moe_frequency = 3: expected an integer in [1, 2]"),
    ],
)
def test_bad_moe_fields_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        model_config(**overrides)
    assert str(info.value).startswith(message)
    assert info.value.field == message.split(" = ")[0]


def test_moe_field_ranges_are_checked_on_a_dense_model_but_not_top_k_against_experts() -> None:
    # A top_k above the (zero) experts is fine until the model is MoE ...
    assert not ModelConfig(num_experts=0, moe_top_k=5).is_moe
    # ... but a value no MoE model could use is refused at once, naming the field.
    with pytest.raises(ConfigError, match=r"^model.moe_router = 'foo'"):
        ModelConfig(num_experts=0, moe_router="foo")


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (
            ["--model.num_experts=6", "--distributed.ep=4"],
            4,
            "distributed.ep = 4: expected a divisor of model.num_experts = 6",
        ),
        (["--distributed.ep=2"], 2, "distributed.ep = 2: expected 1 for a dense model"),
    ],
    ids=["ep_not_dividing_experts", "ep_dense"],
)
def test_moe_layout_rules(overrides: list[str], world_size: int, message: str) -> None:
    config = load_config(None, overrides)
    with pytest.raises(ConfigError) as info:
        config.validate(world_size)
    assert str(info.value).startswith(message)


def test_moe_layouts_that_fit_are_accepted() -> None:
    load_config(None, ["--model.num_experts=4"]).validate(1)
    load_config(None, ["--model.num_experts=4", "--distributed.ep=2"]).validate(2)
    ep_in_shards = ["--model.num_experts=8", "--distributed.ep=2", "--distributed.dp_replicate=2"]
    load_config(None, ep_in_shards).validate(4)
    pipeline = ["--distributed.pp=2", "--data.document_masking=false", "--train.grad_accum_steps=2"]
    load_config(None, ["--model.num_experts=4", *pipeline]).validate(2)
    load_config(None, ["--model.num_experts=4", "--distributed.ep=2", *pipeline]).validate(4)


def test_cli_reports_a_bad_moe_config_in_one_line_and_exits_2(capsys, package_logging) -> None:
    code = main(["train", str(CONFIGS / "train" / "debug_moe.toml"), "--model.moe_router=sigmod"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert err.splitlines() == [
        "kempnerforge: error: model.moe_router = 'sigmod': expected one of 'softmax', "
        "'sigmoid' (did you mean 'sigmoid'?)"
    ]


@pytest.mark.parametrize("capacity", [None, 1.0])
def test_compiled_moe_blocks_match_eager(capacity) -> None:
    """Compiled blocks run the routing's host reads and the grouped matmul eagerly (graph
    breaks) and give the eager outputs and gradients."""
    from kempnerforge.distributed.parallelize import apply_compile
    from kempnerforge.model.transformer import Transformer

    cfg = model_config(n_heads=4, max_seq_len=32, multiple_of=256, moe_capacity_factor=capacity)
    eager, compiled = Transformer(cfg), Transformer(cfg)
    eager.init_weights(1)
    compiled.init_weights(1)
    apply_compile(compiled, backend="aot_eager")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    want, got = eager(ids), compiled(ids)
    want.pow(2).mean().backward()
    got.pow(2).mean().backward()
    # aot_eager decomposes ops (silu, softmax, norms) into other kernels: the model's
    # sums in another order, forward and backward.
    terms = transformer_terms(cfg, seq_len=16)
    assert_reordered_close(got, want, terms=terms)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        assert_reordered_close(q.grad, p.grad, terms=terms)
