"""Mask rules: which keys a query sees (causal, within its document, within a sliding
window), as a function of query and key positions and document ids, and the forms the
kernels take it in: a dense boolean mask, a FlexAttention mask_mod and a block mask.

Every form is built for a (query range, key range) pair of global positions, so a kernel
that attends one block of queries to one block of keys at a time (ring attention's
key/value blocks) builds its own pair's mask from the same rule, and tile_table tells
which pairs the rule hides wholly, leaves whole, or masks by causality alone.
``doc_ids`` always covers the whole sequence (batch, seq): position p's document is
``doc_ids[:, p]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import BlockMask

BLOCK_SIZE = 128
"""Positions per block of a block mask (FlexAttention's default tile)."""

Range = tuple[int, int]
"""Global positions [start, stop)."""


@dataclass(frozen=True)
class MaskRule:
    """Which keys a query sees: never a later position; with ``documents`` only keys of its
    own document; with ``window`` only the ``window`` latest positions, itself included."""

    documents: bool = False
    """Keys must carry the query's document id (packed documents never see each other)."""
    window: int = 0
    """Query p sees keys p - window + 1 .. p (Hugging Face's ``sliding_window``); 0: no
    window."""

    @property
    def is_causal(self) -> bool:
        """Whether the rule is causality alone (SDPA's is_causal kernels, no mask)."""
        return not self.documents and self.window == 0


def visible(
    rule: MaskRule,
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    q_doc: torch.Tensor | None = None,
    k_doc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Elementwise (broadcasting): whether the query at ``q_pos`` sees the key at ``k_pos``;
    ``q_doc`` and ``k_doc`` are their document ids, needed when ``rule.documents``."""
    seen = k_pos <= q_pos
    if rule.window:
        seen = seen & (q_pos - k_pos < rule.window)
    if rule.documents:
        if q_doc is None or k_doc is None:
            raise ValueError("a document rule needs the positions' document ids")
        seen = seen & (q_doc == k_doc)
    return seen


def dense_mask(
    rule: MaskRule,
    doc_ids: torch.Tensor | None,
    q_range: Range,
    k_range: Range,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Boolean (batch, 1, queries, keys), True where the query sees the key; batch is 1
    without a document rule. O(queries * keys): the reference form, and the dense kernel's.
    """
    if rule.documents and doc_ids is None:
        raise ValueError("a document rule needs doc_ids")
    device = doc_ids.device if doc_ids is not None else device
    q_pos = torch.arange(*q_range, device=device)[:, None]
    k_pos = torch.arange(*k_range, device=device)[None, :]
    if not rule.documents:
        return visible(rule, q_pos, k_pos)[None, None]
    assert doc_ids is not None
    q_doc = doc_ids[:, q_range[0] : q_range[1], None]
    k_doc = doc_ids[:, None, k_range[0] : k_range[1]]
    return visible(rule, q_pos, k_pos, q_doc, k_doc)[:, None]


def mask_mod(rule: MaskRule, doc_ids: torch.Tensor | None, q_start: int = 0, k_start: int = 0):
    """The rule as a FlexAttention mask_mod over local indices: query q_idx is position
    ``q_start + q_idx``, key kv_idx position ``k_start + kv_idx``. Indices past the end of
    the sequence (a last, partial tile) are clamped for the document lookup; the key and
    query lengths given to the kernel keep them out of the result."""
    last = 0 if doc_ids is None else doc_ids.shape[1] - 1

    def rule_mask(b, h, q_idx, kv_idx):
        del h
        q_pos, k_pos = q_idx + q_start, kv_idx + k_start
        if not rule.documents:
            return visible(rule, q_pos, k_pos)
        assert doc_ids is not None
        q_doc = doc_ids[b, q_pos.clamp(max=last)]
        k_doc = doc_ids[b, k_pos.clamp(max=last)]
        return visible(rule, q_pos, k_pos, q_doc, k_doc)

    rule_mask.rule = rule  # type: ignore[attr-defined]  # the kernels' cache key
    return rule_mask


def block_mask(
    rule: MaskRule,
    doc_ids: torch.Tensor | None,
    q_range: Range,
    k_range: Range,
    *,
    device: torch.device | str | None = None,
    block_size: int = BLOCK_SIZE,
) -> BlockMask:
    """FlexAttention's BlockMask of the rule for queries ``q_range`` and keys ``k_range``.

    Each (query tile, key tile) pair is classified by tile_table: empty pairs are left
    out, full ones run without the mask_mod, partial ones (the mask_mod decides per
    position) with it. A tile cut short by the end of a range is never full. The tiles'
    table is (batch, queries / block_size, keys / block_size), so memory grows with
    seq**2 / block_size**2, never with seq**2; no (seq, seq) tensor is made.
    """
    device = doc_ids.device if doc_ids is not None else device
    q_docs = k_docs = None
    if rule.documents:
        if doc_ids is None:
            raise ValueError("a document rule needs doc_ids")
        q_docs = tile_documents(doc_ids[:, q_range[0] : q_range[1]], block_size)
        k_docs = tile_documents(doc_ids[:, k_range[0] : k_range[1]], block_size)
    table = tile_table(rule, q_range, k_range, block_size, q_docs, k_docs, device)
    partial = table.some & ~table.every
    q_len, k_len = q_range[1] - q_range[0], k_range[1] - k_range[0]
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(table.every)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod(rule, doc_ids, q_range[0], k_range[0]),
        seq_lengths=(q_len, k_len),
    )


@dataclass(frozen=True)
class TileTable:
    """What a rule makes of each (query tile, key tile) pair, boolean (batch or 1, query
    tiles, key tiles)."""

    some: torch.Tensor
    """Some query of the query tile sees some key of the key tile (else: skip the pair)."""
    every: torch.Tensor
    """Every query sees every key (no mask needed)."""
    causal: torch.Tensor
    """The same positions on both sides and causality alone masks them (a causal
    kernel's pair, no mask tensor)."""


def tile_table(
    rule: MaskRule,
    q_range: Range,
    k_range: Range,
    size: int,
    q_docs: torch.Tensor | None = None,
    k_docs: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> TileTable:
    """The rule's verdict on tiles of ``size`` positions of ``q_range`` against those of
    ``k_range``, from each tile's first and last position and, for a document rule, its
    least and greatest document id (``q_docs``, ``k_docs``: tile_documents of the ranges'
    ids): exact for any document ids, tightest when each document is contiguous. A
    FlexAttention block mask asks it of 128-position tiles (block_mask), ring attention
    of its chunks (ring_blocks.py)."""
    q_first, q_last = _tile_bounds(*q_range, size, device)
    k_first, k_last = _tile_bounds(*k_range, size, device)
    qa, qb = q_first[:, None], q_last[:, None]
    ka, kb = k_first[None, :], k_last[None, :]
    some = ka <= qb
    # Whether nothing but causality hides a key of the pair from a query of it.
    only_causal = torch.ones_like(some)
    if rule.window:
        some = some & (qa - kb < rule.window)
        only_causal = only_causal & (qb - ka < rule.window)
    some, only_causal = some[None], only_causal[None]
    if rule.documents:
        if q_docs is None or k_docs is None:
            raise ValueError("a document rule needs the tiles' document ids")
        q_lo, q_hi = q_docs[0][:, :, None], q_docs[1][:, :, None]
        k_lo, k_hi = k_docs[0][:, None, :], k_docs[1][:, None, :]
        some = some & (q_lo <= k_hi) & (k_lo <= q_hi)
        only_causal = only_causal & (q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)
    whole = (qb - qa + 1 == size) & (kb - ka + 1 == size)
    every = only_causal & ((kb <= qa) & whole)[None]
    causal = only_causal & ((qa == ka) & (qb == kb))[None]
    return TileTable(some, every, causal)


def _tile_bounds(start: int, stop: int, size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last position of each tile of ``size`` positions over [start, stop)."""
    first = torch.arange(start, stop, size, device=device)
    last = (first + size).clamp(max=stop) - 1
    return first, last


def tile_documents(doc_ids: torch.Tensor, size: int) -> torch.Tensor:
    """Least and greatest document id of each tile of ``size`` positions of ``doc_ids``
    (batch, length), stacked: (2, batch, tiles); a last, partial tile is padded with its
    own last id."""
    batch, length = doc_ids.shape
    tiles = -(-length // size)
    pad = tiles * size - length
    if pad:
        doc_ids = torch.cat([doc_ids, doc_ids[:, -1:].expand(batch, pad)], dim=1)
    tiled = doc_ids.view(batch, tiles, size)
    return torch.stack([tiled.amin(-1), tiled.amax(-1)])


def _ordered(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """BlockMask's (num_blocks, indices) of a boolean (batch, q tiles, k tiles) table: per
    query tile, how many key tiles are set and their indices first, in order; with the
    head dimension (1, shared by every head)."""
    counts = table.sum(-1, dtype=torch.int32)
    # Stable descending sort of 0/1 keys puts the set tiles first, in index order.
    order = torch.argsort(table.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts[:, None].contiguous(), order.to(torch.int32)[:, None].contiguous()
