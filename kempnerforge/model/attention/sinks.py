"""Attention sinks (GPT-OSS): a learned logit per query head that joins every softmax
denominator with a value of zero, so a head may put weight on nothing.

With s_h the sink of head h and lse a row's log-sum-exp over the keys it sees, the sink
model's output is the plain output times w = exp(lse) / (exp(lse) + exp(s_h)) =
sigmoid(lse - s_h). So every kernel that yields the log-sum-exp serves it: the CPU's
flash kernel (segments.py), FlexAttention on a GPU (kernels.py) and the ring's merged
blocks (ring.py). Their backward needs no kernel of its own: the flash backward called
with the gradient w * dy, the sink model's output y and the ORIGINAL log-sum-exp computes
P = exp(scores - lse) (the probabilities without the sink), whose rows' weighted sums
give exactly the sink model's dq, dk and dv (P * w are its probabilities, and the row
term rowsum(w * dy * y) is w times its own); the sink's gradient is
-sum over rows of (dy . y) * (1 - w), 1 - w being the sink's probability.
"""

from __future__ import annotations

import math

import torch


def sink_weight(lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """w = sigmoid(lse - sink), fp32 (batch, heads, queries), from the rows' log-sum-exp
    (batch, heads, queries) and the heads' sinks (heads,). A row that sees no key (lse
    -inf) gets weight 0."""
    return torch.sigmoid(lse.float() - sinks.float()[None, :, None])


def apply_sinks(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The sink model's output: out (batch, heads, queries, head_dim) times w, in out's
    dtype."""
    return (out.float() * w[..., None]).to(out.dtype)


def sinks_backward(
    dy: torch.Tensor, y: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the gradient to hand the flash backward, w * dy in dy's dtype; the sinks'
    gradient (heads,), fp32) from the gradient dy of the sink model's output y."""
    rowdot = (dy.float() * y.float()).sum(-1)
    d_sinks = -(rowdot * (1 - w)).sum((0, 2))
    return (dy.float() * w[..., None]).to(dy.dtype), d_sinks


def dense_sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    mask: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Sink attention in plain tensor operations, through autograd: scores (fp32) with the
    sink as one more column, softmax, the sink's column dropped. q (batch, heads, Lq, d),
    k and v (batch, kv_heads, Lk, d) with kv_heads dividing heads; ``mask`` boolean,
    broadcasting to (batch, heads, Lq, Lk), True where seen; ``causal`` aligns query i
    with key i. The dense kernel's and the cached decoder's; O(Lq * Lk) memory."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        rows = torch.arange(q.shape[2], device=q.device)[:, None]
        cols = torch.arange(k.shape[2], device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    sink = sinks.float()[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)
