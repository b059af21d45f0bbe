"""Decoding with a key/value cache: each new position runs through the model once.

``forward_cached`` runs only the new positions of a sequence: every block projects their
queries, keys and values, stores the keys and values in the cache at their absolute
positions, and attends from the new queries to all stored keys so far, or, in a sliding
layer (model.sliding_window), to those its window reaches. The result equals the full
forward's logits at those positions (fp32: to rounding). The cache keeps every position's
keys for every layer; a sliding layer reads only its window's. A block of multi-head
latent attention (model.mla_kv_rank) stores what its keys and values are decompressed
from instead: each position's normalised latent and its rotated key RoPE part, a small
fraction of its heads' keys and values; the new queries read keys and values
decompressed from every stored position.

This is a separate path through the same modules; Transformer.forward, the training
forward, is not involved and keeps its numerics, its compiled blocks and its FSDP hooks.
The path calls the blocks' submodules directly, so it takes a model held whole on one
device: not FSDP-sharded, tensor-parallel or expert-parallel, not a pipeline stage. A
sharded model decodes through its training forward with model/attention/decode_cache.py
(GRPO's rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from kempnerforge.model.attention import (
    Attention,
    LatentAttention,
    MaskRule,
    attend_stored,
    dense_mask,
)
from kempnerforge.model.moe import MoEFeedForward
from kempnerforge.model.transformer import Transformer, TransformerBlock


@dataclass
class KVCache:
    """Per-block keys and values of the positions decoded so far, preallocated.

    ``keys[i]`` and ``values[i]`` belong to the i-th block in layer order, each of shape
    (batch, kv_heads, max_len, head_dim) with RoPE already applied to the keys; for a
    block of latent attention, its normalised latents (batch, 1, max_len, mla_kv_rank)
    and rotated key RoPE parts (batch, 1, max_len, mla_rope_head_size). Positions
    0 .. position - 1 hold data; the next forward_cached call writes from ``position``.
    """

    keys: list[torch.Tensor]
    """Each block's keys, (batch, kv_heads, max_len, head_dim), or latents (MLA)."""
    values: list[torch.Tensor]
    """Each block's values, (batch, kv_heads, max_len, head_dim), or key RoPE parts
    (MLA)."""
    position: int = 0
    """How many positions are stored (the absolute position of the next token)."""

    @classmethod
    def for_model(
        cls,
        model: Transformer,
        max_len: int | None = None,
        *,
        batch: int = 1,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """An empty cache for ``model``: ``max_len`` positions (default and at most
        model.cfg.max_seq_len), on the model's device, in its parameters' dtype unless
        ``dtype`` is given."""
        cfg = model.cfg
        max_len = cfg.max_seq_len if max_len is None else max_len
        if not 1 <= max_len <= cfg.max_seq_len:
            raise ValueError(
                f"a cache of {max_len} positions: expected 1 to model.max_seq_len = "
                f"{cfg.max_seq_len}"
            )
        if batch < 1:
            raise ValueError(f"a cache for a batch of {batch}: expected at least 1")
        keys, values = [], []
        for block in _blocks(model):
            attention = block.attention
            if isinstance(attention, LatentAttention):
                weight = attention.wkv_a.weight
                key_shape = (batch, 1, max_len, attention.kv_rank)
                value_shape = (batch, 1, max_len, attention.rope_dim)
            else:
                weight = attention.wk.weight
                kv_heads = weight.shape[0] // cfg.head_dim
                key_shape = value_shape = (batch, kv_heads, max_len, cfg.head_dim)
            kind = dtype or weight.dtype
            keys.append(torch.zeros(key_shape, dtype=kind, device=weight.device))
            values.append(torch.zeros(value_shape, dtype=kind, device=weight.device))
        return cls(keys, values)

    @property
    def max_len(self) -> int:
        """How many positions the cache holds at most."""
        return self.keys[0].shape[2]

    @property
    def batch(self) -> int:
        """Rows of the batch the cache was made for."""
        return self.keys[0].shape[0]

    def reset(self) -> None:
        """Start over at position 0 (the stored tensors are overwritten as it goes)."""
        self.position = 0


def check_whole_model(model: Transformer) -> None:
    """Raise ValueError unless ``model`` can decode with a cache: the embedding, the head
    and plain (not sharded) parameters on one device."""
    if model.tok_embeddings is None or model.norm is None or model.output is None:
        raise ValueError("cached decoding needs the whole model, not a pipeline stage")
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError(
            "cached decoding needs a model whose parameters are plain tensors on one device, "
            "not a sharded (FSDP, tensor- or expert-parallel) one; use generate_greedy there"
        )


@torch.no_grad()
def forward_cached(
    model: Transformer,
    input_ids: torch.Tensor,
    cache: KVCache,
    *,
    last_only: bool = False,
) -> torch.Tensor:
    """Logits (batch, new, vocab_size) of the new positions input_ids (batch, new).

    The new tokens take absolute positions cache.position .. cache.position + new - 1
    (their RoPE rows), and each attends to every stored position and to the new ones up
    to itself (in a sliding layer, to those of its window). Their keys and values are
    stored and cache.position advances by ``new``.
    MoE blocks route each token as in training, without a capacity limit and without
    recording router statistics (MoEFeedForward.forward_inference). ``last_only`` keeps
    only the last position's logits (batch, 1, vocab_size): a long prompt then never
    materializes logits for every position.
    """
    check_whole_model(model)
    batch, new = input_ids.shape
    start, end = cache.position, cache.position + input_ids.shape[1]
    if new < 1:
        raise ValueError("forward_cached needs at least one new position")
    if batch != cache.batch:
        raise ValueError(f"a batch of {batch} rows for a cache made for {cache.batch}")
    if end > cache.max_len:
        raise ValueError(
            f"{cache.position} cached + {new} new positions exceed the cache's "
            f"{cache.max_len} positions"
        )
    cos, sin = model.rope_cos[:, start:end], model.rope_sin[:, start:end]
    cfg = model.cfg
    keys = {w: _visible_keys(w, start, end, input_ids.device) for w in _windows(model)}
    h = model.embed(input_ids)
    for index, (name, block) in enumerate(_named_blocks(model)):
        seen = keys[cfg.layer_window(int(name))]
        attend = partial(
            _attend,
            attention=block.attention,
            cos=cos,
            sin=sin,
            cache=cache,
            index=index,
            start=start,
            seen=seen,
        )
        feed_forward = block.feed_forward
        if isinstance(feed_forward, MoEFeedForward):
            h = block.residuals(h, attend, feed_forward.forward_inference)
        else:
            h = block.residuals(h, attend, feed_forward)
    cache.position = end
    if last_only:
        h = h[:, -1:]
    logits = model.apply_head(h)
    assert isinstance(logits, torch.Tensor)
    return logits


def _named_blocks(model: Transformer) -> list[tuple[str, TransformerBlock]]:
    blocks = []
    for name, block in model.layers.items():
        if not isinstance(block, TransformerBlock):
            raise TypeError(f"cached decoding runs TransformerBlocks, not {type(block).__name__}")
        blocks.append((name, block))
    return blocks


def _blocks(model: Transformer) -> list[TransformerBlock]:
    return [block for _, block in _named_blocks(model)]


def _windows(model: Transformer) -> set[int]:
    """The sliding windows of the model's layers (0: a layer that sees its whole past)."""
    return {model.cfg.layer_window(int(name)) for name in model.layers}


def _visible_keys(
    window: int, start: int, end: int, device: torch.device
) -> tuple[int, torch.Tensor | None, bool]:
    """What new positions start .. end - 1 see through a layer with ``window`` (0: none):
    (the first cached key any of them sees, the boolean mask of the new queries over the
    keys from there, or None when no mask is needed, whether that is SDPA's is_causal).

    One new position sees every key from the first; the first positions of a sequence see
    their causal triangle unless the window binds inside it; otherwise the mask is the
    window's rule over (new positions, keys from the first seen), at most new x (new +
    window - 1) wide (masks.py).
    """
    first = max(0, start - window + 1) if window else 0
    new = end - start
    if new == 1:
        return first, None, False
    if start == 0 and (not window or new <= window):
        return first, None, True
    mask = dense_mask(MaskRule(window=window), None, (start, end), (first, end), device)
    return first, mask, False


def _attend(
    x: torch.Tensor,
    attention: Attention | LatentAttention,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    index: int,
    start: int,
    seen: tuple[int, torch.Tensor | None, bool],
) -> torch.Tensor:
    """Attention.forward's computation for new positions start.. over the cached ones
    (Attention.project makes their queries, keys and values as training does).

    ``seen`` (from _visible_keys) says which cached keys the new queries read and how:
    from its first key on, under its mask, or causally (the first call of a sequence,
    the training forward's self-attention; SDPA's is_causal would align the causal
    triangle to the first key, not to the new queries' positions, so later calls with
    several new positions take a mask). Grouped key/value heads are repeated to the
    query heads when there are fewer. A model with attention sinks attends through
    their dense form, the sink one more entry of each softmax.
    """
    batch, new, _ = x.shape
    end = start + new
    first, mask, causal = seen
    if isinstance(attention, LatentAttention):
        q, k_all, v_all = _latent_keys_and_values(
            x, attention, cos, sin, cache, index, start, first
        )
        out = F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, is_causal=causal)
        return attention.wo(out.transpose(1, 2).reshape(batch, new, -1))
    q, k, v = attention.project(x, cos, sin)
    keys, values = cache.keys[index], cache.values[index]
    keys[:, :, start:end] = k.transpose(1, 2)
    values[:, :, start:end] = v.transpose(1, 2)
    q = q.transpose(1, 2)
    k_all = keys[:, :, first:end].to(q.dtype)
    v_all = values[:, :, first:end].to(q.dtype)
    out = attend_stored(q, k_all, v_all, mask, attention.sinks, causal)
    return attention.wo(out.transpose(1, 2).reshape(batch, new, -1))


def _latent_keys_and_values(
    x: torch.Tensor,
    attention: LatentAttention,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache: KVCache,
    index: int,
    start: int,
    first: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Latent attention's queries (batch, heads, new, width) of the new positions x, and
    keys and values (batch, heads, positions, width) of positions ``first`` .. so far:
    the new positions' latents and key RoPE parts are stored, then those read
    decompressed."""
    end = start + x.shape[1]
    latent, k_rope = attention.latent(x, cos, sin)
    latents, k_ropes = cache.keys[index], cache.values[index]
    latents[:, 0, start:end] = latent
    k_ropes[:, 0, start:end] = k_rope[:, :, 0]
    q = attention.queries(x, cos, sin)
    stored = latents[:, 0, first:end].to(q.dtype)
    k, v = attention.expand(stored, k_ropes[:, :, first:end].transpose(1, 2).to(q.dtype))
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
