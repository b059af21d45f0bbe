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

import torch

from kempnerforge.config.model import ModelConfig


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

    Per block: the attention norm (dim), q/k/v (dim), the scores (head_dim), the softmax
    and the weighted values (seq_len each), the output projection (dim), the feed-forward
    norm (dim) and the feed-forward in (dim) and out (its hidden width, plus top_k and a
    shared expert summed per token in an MoE block). Then the final norm and the head (dim
    each) and the loss's softmax (vocab). The backward runs the same chain back: twice.
    """
    if cfg.is_moe:
        # The widest expert (the shared one is moe_shared_experts experts wide), then the
        # top_k routed outputs and the shared one summed per token.
        width = cfg.expert_hidden_dim * max(1, cfg.moe_shared_experts)
        ffn_out = width + cfg.moe_top_k + 1
    else:
        ffn_out = cfg.hidden_dim
    block = 5 * cfg.dim + cfg.head_dim + 2 * seq_len + ffn_out
    forward = cfg.n_layers * block + 2 * cfg.dim + cfg.vocab_size
    return 2 * forward if backward else forward
