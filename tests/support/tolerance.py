"""Tolerances for comparing two computations that sum the same terms in different orders.

A sum of n terms in a dtype with unit roundoff u (fp32: 2**-24, bf16: 2**-8) lies within
about n * u * sum|terms| of the exact sum whatever its order (Higham, Accuracy and
Stability of Numerical Algorithms, ch. 4), so two orders differ by at most
2 * n * u * sum|terms|. For A @ B the sum of |terms| is (|A| @ |B|). Through a chain of
matmuls (a forward and its backward) first-order rounding errors add up along the chain,
so n becomes the summed lengths along the longest chain; the largest |result| of the
compared tensor stands in for sum|terms|: for terms of mixed sign the error seen grows like
sqrt(n) * u * |result|, so this keeps a margin of about sqrt(n), while a dropped term or a
missing reduction moves the result by a share of |result| that no n * u reaches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.training.families import family_of


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the gap between 1 and the next number of ``dtype``: 2**-24 for fp32."""
    return torch.finfo(dtype).eps / 2


def reorder_atol(dtype: torch.dtype, terms: int, magnitude: float) -> float:
    """Largest difference two summation orders of ``terms`` terms can give, the terms'
    absolute values summing to ``magnitude``: 2 * terms * u * magnitude."""
    return 2 * terms * unit_roundoff(dtype) * float(magnitude)


def matmul_atol(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on how far two kernels' ``a @ b`` can differ: the inner size k
    summed, 2 * k * u * (|a| @ |b|), the magnitudes taken in float64."""
    k = a.shape[-1]
    return reorder_atol(a.dtype, k, 1.0) * (a.double().abs() @ b.double().abs())


def assert_reordered_close(
    got: torch.Tensor,
    want: torch.Tensor,
    *,
    terms: int,
    magnitude: float | torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Assert ``got`` and ``want`` differ by no more than two summation orders can.

    ``terms`` is the number of terms summed (along the longest chain of sums for a
    composite computation), ``magnitude`` the sum of their absolute values: a float, a
    tensor broadcasting to ``want`` (elementwise, as matmul_atol gives), or by default the
    largest |want|. ``dtype`` is the dtype the sums ran in, by default ``want``'s.
    """
    assert got.shape == want.shape, f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}"
    dtype = dtype or want.dtype
    if magnitude is None:
        magnitude = want.detach().abs().max()
    bound = reorder_atol(dtype, terms, 1.0) * torch.as_tensor(magnitude, dtype=torch.float64)
    diff = (got.detach().double() - want.detach().double()).abs()
    worst = (diff - bound).argmax()
    assert bool((diff <= bound).all()), (
        f"differ by {diff.flatten()[worst].item():.3g} at flat index {worst.item()}, past "
        f"the bound {bound.broadcast_to(diff.shape).flatten()[worst].item():.3g} that "
        f"{terms} terms summed in another order allow in {dtype}"
    )


def transformer_terms(cfg: ModelConfig, seq_len: int, *, backward: bool = True) -> int:
    """The sizes summed along the longest chain of sums through a Transformer's forward
    and its backward, the ``terms`` for comparing two ways of running it.

    Per block: the attention norm (dim), q/k/v (dim), a query or key norm (its width), the
    scores (head_dim), the softmax and the weighted values (seq_len each), the output
    projection (the heads' width), the feed-forward norm (dim) and the feed-forward in
    (dim) and out (its hidden width, plus top_k and a shared expert summed per token in an
    MoE block). Then the final norm and the head (dim
    each) and the loss's softmax (vocab). Each multi-token-prediction module adds a block,
    its input norms (dim each) and its projection (2 * dim). The backward runs the same
    chain back: twice.
    A projection's bias (model.attention_bias, model.moe_expert_bias) is one more term of
    its sum, a sink (model.attention_sinks) one more of the softmax's normaliser.
    Under multi-head latent attention (model.mla_kv_rank) the queries and keys pass
    through a latent: its norm and the projection out of it (each the latent's width, the
    wider of the query and key/value latents) add to the chain; the scores sum the
    query/key heads' width and the output projection the value heads'.
    """
    if cfg.is_moe:
        # The widest expert (the shared one is moe_shared_experts experts wide), then the
        # top_k routed outputs and the shared one summed per token.
        width = cfg.expert_hidden_dim * max(1, cfg.moe_shared_experts)
        ffn_out = width + cfg.moe_top_k + 1
    else:
        ffn_out = cfg.hidden_dim
    # The output projection sums the heads' width; query and key norms their own width.
    heads_width = cfg.n_heads * cfg.v_head_dim
    qk_norm = {"none": 0, "per_head": cfg.head_dim, "projection": heads_width}[cfg.qk_norm]
    latent = 2 * max(cfg.mla_q_rank, cfg.mla_kv_rank)
    block = 4 * cfg.dim + max(cfg.dim, heads_width) + qk_norm + latent + cfg.qk_head_dim
    block += 2 * seq_len
    block += ffn_out
    # One more term per biased projection on the chain (q, k or v; the output; the
    # expert's two) and the sink in each softmax's normaliser.
    block += 2 * cfg.attention_bias + 2 * cfg.moe_expert_bias + cfg.attention_sinks
    # A multi-token-prediction module's block follows the decoder's, after its two input
    # norms and the projection from both (model.mtp_depth, model/mtp.py).
    forward = (cfg.n_layers + cfg.mtp_depth) * block + cfg.mtp_depth * 4 * cfg.dim
    forward += 2 * cfg.dim + cfg.vocab_size
    return 2 * forward if backward else forward


def layout_atol(
    cfg: ModelConfig,
    seq_len: int,
    *,
    tokens: int,
    updates: int,
    magnitude: float,
    norm_terms: int = 0,
    extra_terms: int = 0,
) -> float:
    """Largest difference between a value a training layout logs (a loss, or with
    ``norm_terms`` a gradient norm) and one process's, ``updates`` optimizer steps in.

    The value's own chain: the forward and the ``tokens`` its loss averages, or for a
    gradient norm the forward, the backward, the tokens and the norm's own sum
    (grad_norm_terms). Each earlier update adds one gradient's chain: a gradient that
    differs by a share e moves each weight by about e times its step (Adam divides out the
    gradient's scale), so the loss by about e times what that step changed it, well under
    e * |loss|; these add up over the updates. ``extra_terms``: the chain outside
    transformer_terms (a vision encoder and adapter, cross-attention), per pass.
    """
    gradient = transformer_terms(cfg, seq_len) + 2 * extra_terms + tokens
    if norm_terms:
        own = gradient + norm_terms
    else:
        own = transformer_terms(cfg, seq_len, backward=False) + extra_terms + tokens
    return reorder_atol(torch.float32, own + updates * gradient, magnitude)


def grad_norm_terms(config: JobConfig) -> int:
    """The terms a gradient norm's own sum adds: the squares of the largest parameter's
    elements, then one per parameter; the square root halves the relative difference."""
    with torch.device("meta"):
        model = family_of(config).build_model(config)
    sizes = [p.numel() for p in model.parameters()]
    return (max(sizes) + len(sizes) + 1) // 2


def assert_layout_close(
    got: Sequence[float],
    want: Sequence[float],
    *,
    first_update: int = 0,
    every: int = 1,
    **bound: Any,
) -> None:
    """Assert a layout's values, got[i] logged after first_update + i * every updates, are
    one process's within layout_atol; ``bound`` is layout_atol's other arguments."""
    assert len(got) == len(want), f"{len(got)} values against {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        updates = first_update + i * every
        atol = layout_atol(updates=updates, magnitude=abs(w), **bound)
        assert abs(g - w) <= atol, (
            f"after {updates} updates: {g} against {w} differ by {abs(g - w):.3g}, "
            f"past the bound {atol:.3g} of fp32 sums in another order"
        )


def vlm_terms(config: JobConfig) -> tuple[int, int]:
    """(seq_len, extra_terms) of a vision-language job for layout_atol: the decoder's
    positions, and the forward chain outside the decoder's blocks: the patch's pixels, a
    pretrained tower's blocks (each summed as a Transformer block of its width), the
    encoder's norm, the adapter's two widths, and a cross-attention block (its norms and
    projections, its softmax over an image's tokens) every few decoder layers."""
    assert config.vlm is not None
    spec, cfg = config.vision_spec(), config.model
    tower = spec.hf_config or {}
    width = spec.feature_dim
    block = 5 * width + 2 * spec.num_tokens + tower.get("intermediate_size", 0)
    encoder = 3 * spec.patch_size**2 + width + tower.get("num_hidden_layers", 0) * block
    extra = encoder + 2 * width + cfg.dim
    if config.vlm.arch == "cross_attention":
        layers = cfg.n_layers // config.vlm.cross_attention_every_n_layers
        extra += layers * (4 * cfg.dim + cfg.head_dim + 2 * config.image_tokens(spec))
    return config.decoder_positions(spec), extra


def newton_schulz_sensitivity(matrix: torch.Tensor, steps: int, iterations: int = 10) -> float:
    """Twice the operator norm (Frobenius to Frobenius) of newton_schulz_orthogonalize's
    Jacobian at ``matrix``, taken in float64: an input moved by d in Frobenius norm moves
    the result by at most about d times this. A property of the map at that point, not of
    any machine's kernels.

    The norm is estimated by ``iterations`` power-iteration steps on J^T J (a jvp, then a
    vjp) from a fixed start. The factor 2 is the margin for the second-order terms a
    linearisation leaves out, and for power iteration approaching the largest singular
    value from below.
    """
    from kempnerforge.optim.muon import newton_schulz_orthogonalize

    point = matrix.detach().double()

    def orthogonalize(x: torch.Tensor) -> torch.Tensor:
        return newton_schulz_orthogonalize(x, steps)

    _, pullback = torch.func.vjp(orthogonalize, point)
    direction = torch.randn(
        point.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    direction /= direction.norm()
    norm = 0.0
    for _ in range(iterations):
        _, pushed = torch.func.jvp(orthogonalize, (point,), (direction,))
        norm = float(pushed.norm())
        (pulled,) = pullback(pushed)
        if float(pulled.norm()) == 0.0:
            break
        direction = pulled / pulled.norm()
    return 2.0 * norm


ROUNDING = 2 * unit_roundoff(torch.float32)
"""How far two fp32 kernels' results of one elementwise operation can differ, relative to
the operation's scale: each lies within one rounding (u) of the exact result."""


def muon_atol(
    weight: torch.Tensor,
    grads: Sequence[torch.Tensor],
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
    ns_steps: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise bounds (the weight, the momentum buffer) on how far two fp32 runs of
    Muon's step on one matrix can end apart after len(grads) steps, given the same weight
    and gradients, when their elementwise operations may each round differently (one on a
    shard, one on the whole matrix) and Newton-Schulz is the same program on both.

    Replayed in float64 for the magnitudes, per step: the buffer's multiply and add, each
    one ROUNDING at the scale mu |buf| + |g|, plus the earlier difference times mu; the
    Nesterov update's the same way; that bounds the Newton-Schulz input's difference, whose
    Frobenius norm times newton_schulz_sensitivity bounds every element of the result's
    difference; then the decay and the scaled add, three roundings at |p| + lr * scale *
    |NS|, plus lr * scale times the result's bound, plus the earlier difference decayed.
    """
    mu = momentum
    decay = 1 - lr * weight_decay
    scale = math.sqrt(max(1.0, weight.size(0) / weight.size(1)))
    from kempnerforge.optim.muon import newton_schulz_orthogonalize

    p = weight.detach().double().clone()
    buf = torch.zeros_like(p)
    p_bound, buf_bound = torch.zeros_like(p), torch.zeros_like(p)
    for g in grads:
        g = g.detach().double()
        buf_bound = mu * buf_bound + 2 * ROUNDING * (mu * buf.abs() + g.abs())
        buf = mu * buf + g
        update = g + mu * buf
        update_bound = mu * buf_bound + 2 * ROUNDING * (g.abs() + mu * buf.abs())
        ortho = newton_schulz_orthogonalize(update, ns_steps)
        ortho_bound = newton_schulz_sensitivity(update, ns_steps) * float(update_bound.norm())
        step = lr * scale * ortho
        p_bound = decay * p_bound + lr * scale * ortho_bound
        p_bound += 3 * ROUNDING * (p.abs() + step.abs())
        p = decay * p - step
    return p_bound, buf_bound


def adamw_atol(
    weight: torch.Tensor,
    grads: Sequence[torch.Tensor],
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> torch.Tensor:
    """Elementwise bound on how far two fp32 runs of AdamW's step on one parameter (one on
    a shard, one on the whole tensor; the loop, foreach or fused kernel) can end apart
    after len(grads) steps, given the same weight and gradients.

    AdamW is elementwise: the decay, the lerp of m, the two updates of v, the bias
    correction, the square root, the eps and the addcdiv are about a dozen roundings a step.
    Those of the weight's own update fall at the scale |p| + |step|; those inside m and v
    carry over from step to step (each relative to its own scale: v has no cancellation,
    m's scale is the sum of its terms' |values|), so the t-th step's update is taken as
    12 * t roundings at lr / (1 - beta1**t) * (sum of m's |terms|) / (sqrt(v_hat) + eps).
    Replayed in float64 for the magnitudes.
    """
    beta1, beta2 = betas
    decay = 1 - lr * weight_decay
    p = weight.detach().double().clone()
    m, v, m_terms = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    bound = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.detach().double()
        m = beta1 * m + (1 - beta1) * g
        m_terms = beta1 * m_terms + (1 - beta1) * g.abs()
        v = beta2 * v + (1 - beta2) * g * g
        denom = (v / (1 - beta2**t)).sqrt() + eps
        step_size = lr / (1 - beta1**t)
        step = step_size * m / denom
        bound = decay * bound + 12 * ROUNDING * (p.abs() + t * step_size * m_terms / denom)
        p = decay * p - step
    return bound
