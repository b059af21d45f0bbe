"""Decoding with a key/value cache through the training forward itself.

``Transformer.forward(ids, decode=step)`` runs only the new positions of a batch of rows:
each attention layer stores their keys and values in a ``DecodeCache`` at each row's own
slots, then attends from the new queries to the row's stored keys up to each query's
position (and within the layer's sliding window). Everything else is the training forward:
FSDP gathers a block's weights in its own hooks, tensor parallelism splits the heads and
gathers the logits, so any layout that trains decodes, without a copy of the weights. A
layer's cache is allocated at its first write with the shapes its keys have there (a
tensor-parallel rank's own heads), so the same code serves every layout; a latent-attention
layer stores its decompressed keys and values.

Rows advance at their own positions (a row's prompt has its own length), so each step says
for every new token its RoPE position and the cache slot its key goes to. A step may carry
padding (a finished row, or the positions a sequence-parallel layout needs to split the
new positions evenly): it writes to slots past every real position, which no real query
reads. The logits of a real position equal the full forward's at that position, to the
rounding of a different summation order (GRPO's rollouts: training/objectives/rollouts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kempnerforge.model.attention.sinks import dense_sink_attention


@dataclass
class DecodeCache:
    """Each attention layer's keys and values of ``rows`` rows, ``slots`` positions each,
    allocated at the layer's first write (layer name -> (keys, values), each (rows, slots,
    heads, width))."""

    rows: int
    slots: int
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def stored(
        self, layer: str, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layer``'s keys and values, made like k and v (rows, new, heads, width) at its
        first call."""
        if layer not in self.layers:
            keys = k.new_zeros(self.rows, self.slots, *k.shape[2:])
            self.layers[layer] = keys, v.new_zeros(self.rows, self.slots, *v.shape[2:])
        return self.layers[layer]


@dataclass
class DecodeStep:
    """One forward of new tokens (rows, new) through the cache."""

    cache: DecodeCache
    positions: torch.Tensor
    """(rows, new) int64: each new token's position (its RoPE row and what it may see)."""
    slots: torch.Tensor
    """(rows, new) int64: the cache slot each new token's key and value are written to."""
    read: int
    """Slots 0 .. read - 1 are what the step's queries attend over: past every real
    position of the step, short of the padding's slots."""
    _visible: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def prefill(cls, cache: DecodeCache, length: int, device: torch.device) -> DecodeStep:
        """The first step: positions 0 .. length - 1 of every row, in slots of the same
        numbers."""
        positions = torch.arange(length, device=device).expand(cache.rows, length)
        return cls(cache, positions, positions, length)

    def rope_rows(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE tables (kinds, positions, half) at each new token's position: (kinds,
        rows, new, half), which apply_rope reads row by row."""
        return cos[:, self.positions], sin[:, self.positions]

    def layer(self, name: str, window: int) -> CachedKeys:
        """What attention layer ``name`` (of sliding ``window``, 0 for none) reads in its
        mask's place."""
        return CachedKeys(self, name, window)

    def visible(self, window: int) -> torch.Tensor:
        """(rows, 1, new, read) boolean: the slots each new query sees, those at or before
        its position and, in a sliding layer, within its window."""
        if window not in self._visible:
            slots = torch.arange(self.read, device=self.positions.device)
            position = self.positions[:, :, None]
            seen = slots <= position
            if window:
                seen &= slots > position - window
            self._visible[window] = seen[:, None]
        return self._visible[window]


@dataclass(frozen=True)
class CachedKeys:
    """One attention layer's share of a DecodeStep (Attention.forward and
    LatentAttention.forward take it where the training forward passes the layer's mask)."""

    step: DecodeStep
    layer: str
    window: int

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k and v (rows, new, kv_heads, width) at the step's slots, then attend from
        q (rows, new, heads, width) over the stored keys the step's queries see: (rows,
        new, heads, v's width). Grouped key/value heads are repeated to the query heads;
        a model with sinks attends through their dense form."""
        step = self.step
        keys, values = step.cache.stored(self.layer, k, v)
        rows = torch.arange(k.shape[0], device=k.device)[:, None]
        keys[rows, step.slots] = k.to(keys.dtype)
        values[rows, step.slots] = v.to(values.dtype)
        q = q.transpose(1, 2)
        k_all = keys[:, : step.read].transpose(1, 2).to(q.dtype)
        v_all = values[:, : step.read].transpose(1, 2).to(q.dtype)
        out = attend_stored(q, k_all, v_all, step.visible(self.window), sinks)
        return out.transpose(1, 2)


def attend_stored(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    sinks: torch.Tensor | None = None,
    causal: bool = False,
) -> torch.Tensor:
    """Attention of q (batch, heads, new, width) over stored keys and values (batch,
    kv_heads, keys, width): (batch, heads, new, v's width), under the boolean ``mask``
    (True where seen) or SDPA's ``causal``. Grouped key/value heads are repeated to the
    query heads; a model with sinks attends through their dense form (sinks.py); values
    narrower than the queries (latent attention's) are padded for the kernel, then cut.
    Both cached decoders' (this module's and generation/kv_cache.py's)."""
    if sinks is not None:  # the sink joins each row's softmax
        return dense_sink_attention(q, k, v, sinks, mask, causal)
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    width = v.shape[-1]
    if width < q.shape[-1]:
        v = F.pad(v, (0, q.shape[-1] - width))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return out[..., :width]
