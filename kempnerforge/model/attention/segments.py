"""The CPU kernel of the mask rules: each row is cut into pieces that SDPA's CPU flash
kernel attends one at a time, forward and backward.

FlexAttention has no backward on the CPU in this PyTorch, and a dense mask costs
O(seq**2) memory and work. Here a row is cut along the rule: each document (the whole row
without a document rule) is a piece of its own, attended causally with no mask at all;
a document longer than the rule's window is cut into bands of queries, each with the keys
its window reaches and a small mask; documents shorter than MERGE_LEN are attended
together, a few to a piece, under their small block-diagonal mask. The work is the sum of
the pieces' sizes (each document's own triangle, or a band per window), the memory kept
for backward is O(seq): queries, keys, values, output and one log-sum-exp per query,
never a mask or a score matrix.

The plan (the pieces) is computed once per batch on the host from the batch's document
ids, which live on the CPU here (no device sync), and shared by every layer with the same
rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kempnerforge.model.attention.masks import MaskRule, Range, dense_mask
from kempnerforge.model.attention.sinks import apply_sinks, sink_weight, sinks_backward

MERGE_LEN = 256
"""Documents shorter than this are attended several to a piece (one kernel call per
piece, not per document): a chat corpus or eval requests pack many short ones."""
BAND_LEN = 512
"""Most queries per piece of a document longer than the window (a band); its keys are the
band's queries and the window - 1 positions before the first of them, so a band of the
window's length (at least MIN_BAND_LEN) does about half of its score work on keys its
window reaches, a longer band less."""
MIN_BAND_LEN = 64
"""Fewest queries per band: a tiny window would otherwise cost a kernel call per query."""

_aten = torch.ops.aten


@dataclass(frozen=True)
class Piece:
    """Queries ``q`` of row ``row`` attending keys ``k`` (global positions)."""

    row: int
    q: Range
    k: Range
    causal: bool
    """The keys start with the queries and the rule is causality alone inside the piece
    (one document, within the window): the kernel's is_causal, no mask."""
    shared: bool
    """One document: the piece's mask depends only on its shape and offset, so pieces
    alike share one mask tensor."""


@dataclass(frozen=True)
class Segments:
    """A batch's pieces under one rule, shared by the layers that use the rule."""

    rule: MaskRule
    doc_ids: torch.Tensor | None
    """The batch's document ids (batch, seq), for the merged pieces' masks."""
    pieces: tuple[Piece, ...]
    seq_len: int

    def dense(self) -> torch.Tensor:
        """The rule's dense mask over the whole sequence (for a traced, compiled block)."""
        return dense_mask(self.rule, self.doc_ids, (0, self.seq_len), (0, self.seq_len))


def plan_segments(
    rule: MaskRule, doc_ids: torch.Tensor | None, batch: int, seq_len: int
) -> Segments:
    """The pieces of every row under ``rule``; ``doc_ids`` (batch, seq) on the CPU when the
    rule separates documents."""
    pieces: list[Piece] = []
    for row in range(batch):
        spans = [(0, seq_len)]
        if rule.documents:
            assert doc_ids is not None, "a document rule needs doc_ids"
            spans = _document_spans(doc_ids[row])
        pieces.extend(_row_pieces(rule, row, spans))
    return Segments(rule, doc_ids if rule.documents else None, tuple(pieces), seq_len)


def _document_spans(doc_ids: torch.Tensor) -> list[Range]:
    """[start, stop) of each run of equal document ids along one row."""
    cuts = (torch.nonzero(doc_ids[1:] != doc_ids[:-1]).flatten() + 1).tolist()
    bounds = [0, *cuts, doc_ids.shape[0]]
    return list(zip(bounds, bounds[1:], strict=False))


def _row_pieces(rule: MaskRule, row: int, spans: list[Range]) -> list[Piece]:
    """One row's pieces: short documents merged, the others each alone or in bands."""
    pieces: list[Piece] = []
    group: list[Range] = []

    def flush() -> None:
        if len(group) == 1:
            pieces.extend(_span_pieces(rule, row, *group[0]))
        elif group:
            whole = (group[0][0], group[-1][1])
            pieces.append(Piece(row, whole, whole, causal=False, shared=False))
        group.clear()

    for start, stop in spans:
        if stop - start >= MERGE_LEN:
            flush()
            pieces.extend(_span_pieces(rule, row, start, stop))
            continue
        group.append((start, stop))
        if group[-1][1] - group[0][0] >= MERGE_LEN:
            flush()
    flush()
    return pieces


def _span_pieces(rule: MaskRule, row: int, start: int, stop: int) -> list[Piece]:
    """One document's pieces: the whole of it when the window does not bind inside it,
    else bands of queries (the window's length, within MIN_BAND_LEN and BAND_LEN) with
    the keys their window reaches."""
    window = rule.window
    if not window or stop - start <= window:
        return [Piece(row, (start, stop), (start, stop), causal=True, shared=True)]
    pieces = []
    band = min(BAND_LEN, max(window, MIN_BAND_LEN))
    for first in range(start, stop, band):
        last = min(first + band, stop)
        keys = (max(start, first - window + 1), last)
        causal = keys[0] == first and last - first <= window
        pieces.append(Piece(row, (first, last), keys, causal=causal, shared=True))
    return pieces


def _piece_mask(
    segments: Segments, piece: Piece, dtype: torch.dtype, cache: dict
) -> torch.Tensor | None:
    """The piece's additive mask (0 where seen, -inf elsewhere) in the queries' dtype, as
    the CPU flash kernel takes it; None for a causal piece. Pieces of one document share
    one tensor per shape and offset."""
    if piece.causal:
        return None
    key = (piece.q[1] - piece.q[0], piece.k[1] - piece.k[0], piece.q[0] - piece.k[0])
    if piece.shared and key in cache:
        return cache[key]
    rule = segments.rule
    if piece.shared:
        # Inside one document only the positions matter, and only their offset.
        seen = dense_mask(MaskRule(window=rule.window), None, piece.q, piece.k)[0, 0]
    else:
        assert segments.doc_ids is not None
        row = segments.doc_ids[piece.row : piece.row + 1]
        seen = dense_mask(rule, row, piece.q, piece.k)[0, 0]
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, float("-inf"))
    if piece.shared:
        cache[key] = mask
    return mask


class _SegmentsAttention(torch.autograd.Function):
    """Attention of q (batch, heads, seq, head_dim) over k, v (batch, kv_heads, seq,
    head_dim) piece by piece; grouped heads are read as they are. With ``sinks`` (heads,)
    each row's output is scaled by its sink weight (sinks.py), and backward hands the
    flash backward the scaled gradient with the original log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, segments: Segments):  # type: ignore[override]
        batch, heads, seq_len, head_dim = q.shape
        # (batch, seq, heads, dim) storage: the caller transposes back for free.
        out = q.new_empty(batch, seq_len, heads, head_dim).transpose(1, 2)
        lse = q.new_empty(batch, heads, seq_len, dtype=torch.float32)
        masks: dict = {}
        for piece in segments.pieces:
            qs, ks = _slices(piece)
            mask = _piece_mask(segments, piece, q.dtype, masks)
            piece_out, piece_lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q[qs], k[ks], v[ks], 0.0, piece.causal, attn_mask=mask
            )
            out[qs] = piece_out
            lse[qs] = piece_lse
        weight = None
        if sinks is not None:
            weight = sink_weight(lse, sinks)
            out.copy_(apply_sinks(out, weight))
        ctx.save_for_backward(q, k, v, out, lse, weight)
        ctx.segments = segments
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[override]
        q, k, v, out, lse, weight = ctx.saved_tensors
        segments: Segments = ctx.segments
        d_sinks = None
        if weight is not None:
            grad_out, d_sinks = sinks_backward(grad_out, out, weight)
        dq = torch.empty_like(q)  # every query lies in exactly one piece
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)  # bands share keys
        masks: dict = {}
        for piece in segments.pieces:
            qs, ks = _slices(piece)
            mask = _piece_mask(segments, piece, q.dtype, masks)
            gq, gk, gv = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                grad_out[qs],
                q[qs],
                k[ks],
                v[ks],
                out[qs],
                lse[qs],
                0.0,
                piece.causal,
                attn_mask=mask,
            )
            dq[qs] = gq
            dk[ks] += gk
            dv[ks] += gv
        return dq, dk, dv, d_sinks, None


def _slices(piece: Piece) -> tuple[tuple[slice, slice, slice], tuple[slice, slice, slice]]:
    row = slice(piece.row, piece.row + 1)
    return (row, slice(None), slice(*piece.q)), (row, slice(None), slice(*piece.k))


def segments_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    segments: Segments,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention under ``segments``' rule: q (batch, heads, seq, head_dim), k and v with
    the same or fewer (grouped) heads, and optionally each head's sink logit (heads,);
    returns (batch, heads, seq, head_dim)."""
    out = _SegmentsAttention.apply(q, k, v, sinks, segments)
    assert isinstance(out, torch.Tensor)
    return out
