"""Ring attention's blocks: a layer's mask rule (masks.py) as the ring applies it, which
pairs of chunks it hides wholly, leaves whole or masks by causality alone, and one
block's attention with its log-sum-exp, forward and backward (ring.py runs them around
the ring and merges the blocks)."""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kempnerforge.model.attention.masks import (
    MaskRule,
    Range,
    TileTable,
    dense_mask,
    tile_documents,
    tile_table,
)

_CPU_ATTEND = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_ATTEND_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
MATH_SCORES_PER_CHUNK = 2**22
"""Scores the math kernel holds at once (16 MiB in fp32): it walks the queries in chunks of
rows so that a block never materialises its whole (queries, keys) score matrix."""


class Block(enum.Enum):
    """What a layer's rule makes of queries in one chunk against keys in another."""

    EMPTY = "empty"
    """No query sees any key: the pair is skipped, no compute."""
    FULL = "full"
    """Every query sees every key: attention without a mask."""
    CAUSAL = "causal"
    """The same positions on both sides and only causality masks: the kernel's causal flag."""
    MASKED = "masked"
    """Anything else: the rule's dense mask of the pair (masks.py dense_mask)."""


@dataclass(frozen=True)
class RingMask:
    """A layer's mask rule as ring attention applies it: what the rule makes of each pair
    of the sequence's ``2 * ring`` chunks, and the whole sequence's document ids for the
    pairs that need a mask. Prepared once per forward per distinct rule (ring_masks) and
    shared by the layers with that rule."""

    rule: MaskRule
    doc_ids: torch.Tensor | None
    """(batch, seq) document ids of the whole sequence, on the device; None without a
    document rule."""
    kinds: tuple[tuple[Block, ...], ...]
    """kinds[q_chunk][k_chunk], over every row of the batch."""

    def bias(self, q_range: Range, k_range: Range, dtype: torch.dtype, device: torch.device):
        """The rule's additive mask of queries ``q_range`` against keys ``k_range``
        (batch or 1, 1, queries, keys) in ``dtype``, -inf where hidden, and which query
        rows see any key (batch or 1, 1, queries)."""
        seen = dense_mask(self.rule, self.doc_ids, q_range, k_range, device)
        bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device)
        bias.masked_fill_(~seen, float("-inf"))
        return bias, seen.any(-1)


def ring_masks(
    rules: Sequence[MaskRule], doc_ids: torch.Tensor | None, seq_len: int, ring: int
) -> list[RingMask]:
    """One RingMask per rule in ``rules`` (a layer's each), built once per distinct rule
    for a sequence of ``seq_len`` positions cut into ``2 * ring`` chunks; ``doc_ids``
    (batch, seq_len) is the whole sequence's, needed when a rule separates documents.

    One host read per forward: each chunk's least and greatest document id (4 * ring ids
    a row), from which tile_table tells, per rule, the chunk pairs that no query sees
    (skipped), that every query sees whole, and that causality alone masks."""
    size = seq_len // (2 * ring)
    docs = None
    if doc_ids is not None and any(rule.documents for rule in rules):
        docs = tile_documents(doc_ids, size).cpu()
    prepared: dict[MaskRule, RingMask] = {}
    for rule in rules:
        if rule not in prepared:
            whole = (0, seq_len)
            table = tile_table(rule, whole, whole, size, docs, docs, "cpu")
            prepared[rule] = RingMask(rule, doc_ids if rule.documents else None, _kinds(table))
    return [prepared[rule] for rule in rules]


def _kinds(table: TileTable) -> tuple[tuple[Block, ...], ...]:
    """Each chunk pair's Block over every row: skipped only where no row's queries see a
    key, unmasked only where every row's queries see every key (or causality alone)."""
    empty = (~table.some.any(0)).tolist()
    full, causal = table.every.all(0).tolist(), table.causal.all(0).tolist()

    def kind(i: int, j: int) -> Block:
        if empty[i][j]:
            return Block.EMPTY
        if full[i][j]:
            return Block.FULL
        return Block.CAUSAL if causal[i][j] else Block.MASKED

    chunks = range(len(empty))
    return tuple(tuple(kind(i, j) for j in chunks) for i in chunks)


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
