"""Grouped-query causal self-attention under its layer's mask rule (packed documents, a
sliding window)."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention.decode_cache import CachedKeys
from kempnerforge.model.attention.kernels import LayerMask, attend
from kempnerforge.model.attention.masks import MaskRule, dense_mask
from kempnerforge.model.attention.ring import ring_attention
from kempnerforge.model.attention.ring_blocks import RingMask
from kempnerforge.model.attention.rope import apply_rope
from kempnerforge.model.attention.sequence_split import (
    SequenceSplit,
    active_split,
    exchanged_heads,
    heads_to_sequence,
    kv_sequence_to_heads,
    sequence_to_heads,
)
from kempnerforge.model.norm import HeadRMSNorm, ProjectionRMSNorm, RMSNorm


def needs_document_mask(doc_ids: torch.Tensor | None) -> bool:
    """Whether any row of ``doc_ids`` (batch, seq) holds more than one document.

    A batch whose rows are each one document needs no mask beyond causality, and the
    causal kernels (is_causal, no mask tensor) are the fast ones; with packed documents
    most windows of a corpus of long documents are like that. Call it on the batch's
    host copy, before it moves to the device: there the answer costs no device sync.
    """
    if doc_ids is None:
        return False
    return bool((doc_ids[:, 1:] != doc_ids[:, :-1]).any())


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean mask (batch, 1, seq, seq): True where query i may attend to key j.

    A key is visible when it is not in the future and belongs to the same document as the
    query, so packed documents never see each other. The diagonal is always True, so no
    row is fully masked. The dense form of MaskRule(documents=True) (masks.py), which
    train.attention_kernel = "dense" attends with; O(seq**2) memory.
    """
    whole = (0, doc_ids.shape[1])
    return dense_mask(MaskRule(documents=True), doc_ids, whole, whole)


class Attention(nn.Module):
    """Multi-head attention with n_kv_heads <= n_heads key/value heads (GQA), RoPE on q and k,
    optionally an RMSNorm of q and k before RoPE (model.qk_norm), projection biases
    (model.attention_bias) and a sink logit per head (model.attention_sinks).

    Query head h reads key/value head h // (n_heads / n_kv_heads). Head counts are read from
    the projected shapes, not the config, so a tensor-parallel shard (fewer local heads) runs
    the same code. Layer ``index`` rotates by its own RoPE table (ModelConfig.layer_rope).
    """

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        """Channels per head; RoPE rotates them in two halves."""
        self.rope_kind = cfg.layer_rope(index)
        """Which of the model's RoPE tables (the first axis of cos and sin) this layer uses."""
        self.query_scale: float | None = None
        """sqrt(head_dim / model.attention_scale_size) times YaRN's logit multiplier
        (ModelConfig.attention_logit_multiplier): folded into the queries so every
        kernel's default 1 / sqrt(head_dim) gives 1 / sqrt(attention_scale_size) times
        the multiplier; None when it is 1."""
        scale = cfg.attention_logit_multiplier
        if cfg.attention_scale_size not in (None, cfg.head_dim):
            scale *= math.sqrt(cfg.head_dim / cfg.attention_scale_size)
        if scale != 1.0:
            self.query_scale = scale
        bias = cfg.attention_bias
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        """Query projection (with a bias under model.attention_bias, as the other three)."""
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        """Key projection (kv_heads heads)."""
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=bias)
        """Value projection (kv_heads heads)."""
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=bias)
        """Output projection into the residual stream; its init is depth-scaled."""
        self.sinks: nn.Parameter | None = None
        """model.attention_sinks: one sink logit per query head (sinks.py); split with the
        heads under tensor parallelism (a DTensor there)."""
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(cfg.n_heads))
        self.qk_norm = cfg.qk_norm
        """model.qk_norm: which of q_norm / k_norm's forms this layer has, if any."""
        self.q_norm: RMSNorm | None = None
        """Query norm: a head-sized gain ('per_head') or the projection's ('projection')."""
        self.k_norm: RMSNorm | None = None
        """Key norm, as q_norm over the key/value heads."""
        centered = cfg.zero_centered_norms
        if cfg.qk_norm == "per_head":
            self.q_norm = HeadRMSNorm(cfg.head_dim, cfg.norm_eps, zero_centered=centered)
            self.k_norm = HeadRMSNorm(cfg.head_dim, cfg.norm_eps, zero_centered=centered)
        elif cfg.qk_norm == "projection":
            q_width, kv_width = cfg.n_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
            self.q_norm = ProjectionRMSNorm(q_width, cfg.norm_eps, zero_centered=centered)
            self.k_norm = ProjectionRMSNorm(kv_width, cfg.norm_eps, zero_centered=centered)
        self.sequence_split: SequenceSplit | None = None
        """Under context parallelism: x is this rank's slice of each sequence, and the
        heads are exchanged for the whole sequence around attention (sequence_split.py)."""

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of x (batch, seq, dim), each (batch, seq, heads,
        head_dim): projected, q and k normalised (model.qk_norm) and rotated by this
        layer's table of the RoPE rows cos and sin (rope kinds, seq, head_dim // 2), the
        queries scaled by query_scale. The cached decoder (generation/kv_cache.py) shares
        it."""
        batch, seq_len, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if self.qk_norm == "projection":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        if self.qk_norm == "per_head":
            assert self.q_norm is not None and self.k_norm is not None
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = cos[self.rope_kind], sin[self.rope_kind]
        q = apply_rope(q, cos, sin)
        if self.query_scale is not None:
            q = q * self.query_scale
        return q, apply_rope(k, cos, sin), v

    def local_sinks(self) -> torch.Tensor | None:
        """The sink logits of the heads this rank projects (all of them, or under tensor
        parallelism its shard), as a plain tensor; None without sinks."""
        if self.sinks is None:
            return None
        sinks = self.sinks
        return sinks.to_local() if isinstance(sinks, DTensor) else sinks

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: LayerMask | CachedKeys = None,
    ) -> torch.Tensor:
        """Attend causally over x (batch, seq, dim) under ``mask``, this layer's mask from
        prepare_masks (kernels.py): None for causality alone (SDPA's is_causal kernels).
        A decoding step's CachedKeys instead stores x's keys and values and attends over
        the cache (decode_cache.py).

        Under context parallelism x holds this rank's positions, cos and sin their rows,
        and the mask covers the whole sequence, which attention sees after the exchange;
        under ring attention (a split with a ring) the mask is the layer's RingMask, which
        ring.py applies to each pair of chunks.
        """
        batch, seq_len, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if isinstance(mask, CachedKeys):
            out = mask.attend(q, k, v, self.local_sinks())
        else:
            out = attend_heads(q, k, v, mask, active_split(self), self.local_sinks())
        return self.wo(out.reshape(batch, seq_len, -1))


def attend_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LayerMask,
    split: SequenceSplit | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of q (batch, seq, heads, head_dim) over k and v (batch, seq,
    kv_heads, head_dim) under ``mask``: (batch, seq, heads, v's head_dim). Under context
    parallelism (``split``) the heads are exchanged for the whole sequence around the
    kernel, or past the head count a ring of key/value blocks runs (ring.py); the
    self-attention kinds (standard, latent) share it."""
    if split is not None and split.ring > 1:  # past the head count (ring.py)
        assert isinstance(mask, RingMask), "a ring's masks come from prepare_masks(ring=)"
        return ring_attention(q, k, v, split, mask, sinks)
    assert not isinstance(mask, RingMask)
    if split is not None:
        q = sequence_to_heads(q, split)
        k, v = kv_sequence_to_heads(k, split), kv_sequence_to_heads(v, split)
        sinks = None if sinks is None else exchanged_heads(sinks, split)
    out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, sinks)
    out = out.transpose(1, 2)
    return out if split is None else heads_to_sequence(out, split)
