"""Ring attention's blocks: the rule of which keys a query sees, which pairs of chunks a
rule masks wholly or not at all, and one block's attention with its log-sum-exp, forward
and backward (ring.py runs them around the ring and merges the blocks)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

_CPU_ATTEND = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_ATTEND_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
MATH_SCORES_PER_CHUNK = 2**22
"""Scores the math kernel holds at once (16 MiB in fp32): it walks the queries in chunks of
rows so that a block never materialises its whole (queries, keys) score matrix."""


def visible(
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Whether each query may attend to each key: the key is not after the query, belongs
    to the same document, and, with ``window`` > 0, is fewer than ``window`` positions back.

    ``q_pos`` (Lq,) and ``k_pos`` (Lk,) are global positions; the answer is (Lq, Lk), or
    (batch, Lq, Lk) with the documents' ids ``q_doc`` (batch, Lq) and ``k_doc`` (batch, Lk).
    """
    back = q_pos[:, None] - k_pos[None, :]
    seen = back >= 0
    if window > 0:
        seen = seen & (back < window)
    if q_doc is not None and k_doc is not None:
        seen = seen & (q_doc[:, :, None] == k_doc[:, None, :])
    return seen


class Block(enum.Enum):
    """What the rules make of queries in one chunk against keys in another."""

    EMPTY = "empty"
    """No query sees any key: the pair is skipped, no compute."""
    FULL = "full"
    """Every query sees every key: attention without a mask."""
    CAUSAL = "causal"
    """The same positions on both sides and only causality masks: the kernel's causal flag."""
    MASKED = "masked"
    """Anything else: a mask made from the rule (visible)."""


def span_block(q: tuple[int, int], k: tuple[int, int], window: int) -> Block:
    """What causality and the window make of queries at positions ``[q0, q1)`` against keys
    at ``[k0, k1)``."""
    (q0, q1), (k0, k1) = q, k
    if k0 > q1 - 1 or (window > 0 and q0 - (k1 - 1) >= window):
        return Block.EMPTY
    near = window == 0 or (q1 - 1) - k0 < window  # no key is too far back for any query
    if k1 - 1 <= q0 and near:
        return Block.FULL
    if (q0, q1) == (k0, k1) and near:
        return Block.CAUSAL
    return Block.MASKED


@dataclass(frozen=True)
class ChunkDocuments:
    """The smallest and largest document id of each chunk of every row, read once per
    forward: enough to tell the chunk pairs no query can see (their ids never meet) and
    the pairs inside one document, without reading a mask."""

    low: list[list[int]]
    """low[row][chunk]."""
    high: list[list[int]]
    """high[row][chunk]."""

    @classmethod
    def of(cls, doc_ids: torch.Tensor, chunks: int) -> ChunkDocuments:
        """From ``doc_ids`` (batch, seq) cut into ``chunks`` equal chunks: one host read."""
        per_chunk = doc_ids.reshape(doc_ids.shape[0], chunks, -1)
        both = torch.stack([per_chunk.amin(-1), per_chunk.amax(-1)]).tolist()
        return cls(low=both[0], high=both[1])

    def block(self, q_chunk: int, k_chunk: int) -> Block:
        """EMPTY when no row's query and key ids can meet, FULL when every row's queries
        and keys all belong to one document, MASKED otherwise."""
        rows = range(len(self.low))
        q_lo, q_hi = [self.low[r][q_chunk] for r in rows], [self.high[r][q_chunk] for r in rows]
        k_lo, k_hi = [self.low[r][k_chunk] for r in rows], [self.high[r][k_chunk] for r in rows]
        if all(k_hi[r] < q_lo[r] or k_lo[r] > q_hi[r] for r in rows):
            return Block.EMPTY
        if all(q_lo[r] == q_hi[r] == k_lo[r] == k_hi[r] for r in rows):
            return Block.FULL
        return Block.MASKED


def pair_block(by_positions: Block, by_documents: Block) -> Block:
    """The two verdicts on one pair of chunks together."""
    if Block.EMPTY in (by_positions, by_documents):
        return Block.EMPTY
    return by_positions if by_documents is Block.FULL else Block.MASKED


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block: Block, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: (out in q's dtype, its log-sum-exp in fp32), shaped
    (batch, heads, Lq, head_dim) and (batch, heads, Lq).

    q is (batch, heads, Lq, head_dim), k and v (batch, kv_heads, Lk, head_dim) with
    kv_heads dividing heads; ``bias`` (additive, q's dtype, -inf where hidden) broadcasts
    to (batch, 1, Lq, Lk), only for MASKED. A row that sees no key comes out 0 with an
    arbitrary log-sum-exp: the caller knows those rows from its mask. On a CPU the fused
    kernel of scaled_dot_product_attention (which returns the log-sum-exp), elsewhere
    the math kernel.
    """
    causal = block is Block.CAUSAL
    if q.device.type == "cpu":
        out, lse = _CPU_ATTEND(q, k, v, 0.0, causal, attn_mask=bias)
        return out, lse
    return math_attend(q, k, v, causal, bias)


def attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    block: Block,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of (dq, dk, dv), the key/value gradients summed over the query
    heads that read each key/value head.

    ``out`` and ``lse`` are the whole attention's (every block merged), not this block's:
    with them the softmax probabilities recomputed here are the final ones, so the
    block's gradients are its exact share of the whole's.
    """
    causal = block is Block.CAUSAL
    if q.device.type == "cpu":
        return _CPU_ATTEND_BACKWARD(dout, q, k, v, out, lse, 0.0, causal, attn_mask=bias)
    return math_attend_backward(dout, q, k, v, out, lse, causal, bias)


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """(batch, heads, L, d) -> (batch, kv_heads, heads / kv_heads, L, d), in fp32."""
    b, h, length, d = q.shape
    return q.float().reshape(b, kv_heads, h // kv_heads, length, d)


def _scores(
    q: torch.Tensor, k: torch.Tensor, rows: slice, causal: bool, bias: torch.Tensor | None
) -> torch.Tensor:
    """Scaled scores of grouped queries ``rows`` against k (batch, kv_heads, Lk, d), fp32,
    with the block's mask added: (batch, kv_heads, groups, rows, Lk)."""
    scores = (q[:, :, :, rows] @ k.transpose(-1, -2)[:, :, None]) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias[:, :, None, rows].float()
    if causal:
        first = rows.start or 0
        query = torch.arange(first, first + scores.shape[-2], device=q.device)
        key = torch.arange(scores.shape[-1], device=q.device)
        scores = scores.masked_fill(key[None, :] > query[:, None], -math.inf)
    return scores


def _row_chunks(q: torch.Tensor, keys: int) -> list[slice]:
    """The query rows of q (batch, heads, Lq, d) in chunks of MATH_SCORES_PER_CHUNK scores."""
    b, h, length, _ = q.shape
    step = max(1, MATH_SCORES_PER_CHUNK // max(1, b * h * keys))
    return [slice(i, min(i + step, length)) for i in range(0, length, step)]


def math_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """attend in plain tensor operations, in fp32, a chunk of query rows at a time."""
    kv_heads = k.shape[1]
    grouped, kf, vf = _grouped(q, kv_heads), k.float(), v.float()
    outs, lses = [], []
    for rows in _row_chunks(q, k.shape[2]):
        scores = _scores(grouped, kf, rows, causal, bias)
        lse = torch.logsumexp(scores, -1)
        # A row that sees nothing has lse -inf; its probabilities are 0, not NaN.
        probs = torch.exp(scores - lse.nan_to_num(neginf=0.0)[..., None])
        outs.append(probs @ vf[:, :, None])
        lses.append(lse)
    out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def math_attend_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """attend_backward in plain tensor operations, in fp32, a chunk of query rows at a time."""
    kv_heads = k.shape[1]
    grouped, kf, vf = _grouped(q, kv_heads), k.float(), v.float()
    d_out, whole_out = _grouped(dout, kv_heads), _grouped(out, kv_heads)
    whole_lse = lse.float().reshape(grouped.shape[:-1])
    dq = torch.empty_like(grouped)
    dk, dv = torch.zeros_like(kf), torch.zeros_like(vf)
    scale = 1.0 / math.sqrt(q.shape[-1])
    for rows in _row_chunks(q, k.shape[2]):
        probs = torch.exp(_scores(grouped, kf, rows, causal, bias) - whole_lse[..., rows, None])
        g_out = d_out[:, :, :, rows]
        dv += (probs.transpose(-1, -2) @ g_out).sum(2)
        d_probs = g_out @ vf.transpose(-1, -2)[:, :, None]
        rowdot = (g_out * whole_out[:, :, :, rows]).sum(-1, keepdim=True)
        d_scores = probs * (d_probs - rowdot) * scale
        dq[:, :, :, rows] = d_scores @ kf[:, :, None]
        dk += (d_scores.transpose(-1, -2) @ grouped[:, :, :, rows]).sum(2)
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
