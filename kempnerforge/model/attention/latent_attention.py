"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): keys and values decompressed from
one small latent vector per position, so a decoder's cache holds that latent instead of
every head's keys and values.

Per position x (dim):

- queries: wq (one projection), or wq_a -> q_norm -> wq_b through a latent of
  model.mla_q_rank; each head's query is a part without RoPE (mla_nope_head_size) and a
  part with it (mla_rope_head_size);
- latent: wkv_a gives model.mla_kv_rank latent channels, normalised by kv_norm, and one
  key RoPE part (mla_rope_head_size) that every head shares;
- keys and values: wkv_b decompresses the latent into each head's key part without RoPE
  and its value (mla_value_head_size); a head's key is [that part, the shared RoPE part];
- logits q.k / sqrt(nope + rope), times ModelConfig.attention_logit_multiplier (YaRN's
  mscale_all_dim), folded into the queries; the output projection wo reads n_heads
  values.

RoPE rotates only the RoPE parts, in halves (channel i with i + rope / 2) as everywhere
in kempnerforge; DeepSeek's checkpoints pair neighbouring channels instead, which import
and export permute (interop/architectures/deepseek_v3.py). The latent norms' epsilon is
DeepSeek's 1e-6 whatever model.norm_eps says, as its reference builds them.

The query/key heads are wider than the value heads. SDPA and FlexAttention take the
values as they are; the kernels that need one width (the CPU's per-document flash
pieces, a dense mask, the ring's blocks) get the values padded with zeros to the
query/key width, and the padding is cut from the output, which is exact.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention.decode_cache import CachedKeys
from kempnerforge.model.attention.kernels import LayerMask
from kempnerforge.model.attention.rope import apply_rope
from kempnerforge.model.attention.self_attention import attend_heads
from kempnerforge.model.attention.sequence_split import SequenceSplit, active_split
from kempnerforge.model.grad_identity import summed_grad
from kempnerforge.model.norm import RMSNorm

LATENT_NORM_EPS = 1e-6
"""The epsilon of q_norm and kv_norm: DeepSeek's reference builds them with its RMSNorm's
default, not the config's rms_norm_eps."""


class LatentAttention(nn.Module):
    """Multi-head latent attention of one block (see the module's docstring).

    Head counts are read from the projected shapes, so the code is the one a shard of
    heads would run. Layer ``index`` rotates by its own RoPE table (ModelConfig.layer_rope).
    """

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        self.nope_dim = cfg.mla_nope_head_size
        """Channels of a query or key head without RoPE."""
        self.rope_dim = cfg.mla_rope_head_size
        """Channels of a query or key head with RoPE (the key's shared by every head)."""
        self.value_dim = cfg.mla_value_head_size
        """Channels of a value head."""
        self.kv_rank = cfg.mla_kv_rank
        """Width of the key/value latent."""
        self.rope_kind = cfg.layer_rope(index)
        """Which of the model's RoPE tables (the first axis of cos and sin) this layer uses."""
        multiplier = cfg.attention_logit_multiplier
        self.query_scale: float | None = None if multiplier == 1.0 else multiplier
        """ModelConfig.attention_logit_multiplier, folded into the queries; None when 1."""
        heads, qk = cfg.n_heads, cfg.qk_head_dim
        centered = cfg.zero_centered_norms
        self.wq: nn.Linear | None = None
        """The query projection when model.mla_q_rank is 0."""
        self.wq_a: nn.Linear | None = None
        """Into the query latent (model.mla_q_rank > 0)."""
        self.q_norm: RMSNorm | None = None
        """Normalises the query latent."""
        self.wq_b: nn.Linear | None = None
        """From the query latent to every head's query."""
        if cfg.mla_q_rank:
            self.wq_a = nn.Linear(cfg.dim, cfg.mla_q_rank, bias=False)
            self.q_norm = RMSNorm(cfg.mla_q_rank, LATENT_NORM_EPS, zero_centered=centered)
            self.wq_b = nn.Linear(cfg.mla_q_rank, heads * qk, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, heads * qk, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, self.kv_rank + self.rope_dim, bias=False)
        """Into the key/value latent and the shared key RoPE part."""
        self.kv_norm = RMSNorm(self.kv_rank, LATENT_NORM_EPS, zero_centered=centered)
        """Normalises the key/value latent (not the RoPE part)."""
        self.wkv_b = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.value_dim), bias=False)
        """From the latent to each head's key part without RoPE and its value."""
        self.wo = nn.Linear(heads * self.value_dim, cfg.dim, bias=False)
        """Output projection into the residual stream; its init is depth-scaled."""
        self.sequence_split: SequenceSplit | None = None
        """Under context parallelism: x is this rank's slice of each sequence, and the
        heads are exchanged for the whole sequence around attention (sequence_split.py)."""
        self.head_group: dist.ProcessGroup | None = None
        """Under tensor parallelism: the group the heads are split over. The key RoPE part,
        computed whole on every rank, is shared by every head, so each rank's gradient of
        it is its heads' share, summed over this group."""

    def queries(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Queries (batch, seq, heads, nope + rope) of x (batch, seq, dim): the RoPE part
        rotated by this layer's table of the rows cos and sin, all scaled by
        query_scale."""
        batch, seq_len, _ = x.shape
        if self.wq is not None:
            q = self.wq(x)
        else:
            assert self.wq_a is not None and self.q_norm is not None and self.wq_b is not None
            q = self.wq_b(self.q_norm(self.wq_a(x)))
        q = q.view(batch, seq_len, -1, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos[self.rope_kind], sin[self.rope_kind])
        q = torch.cat([q_nope, q_rope], dim=-1)
        return q if self.query_scale is None else q * self.query_scale

    def latent(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What a position leaves for the keys and values: its normalised latent (batch,
        seq, kv_rank) and its rotated key RoPE part (batch, seq, 1, rope), the two
        tensors the cached decoder stores."""
        batch, seq_len, _ = x.shape
        latent, k_rope = self.wkv_a(x).split([self.kv_rank, self.rope_dim], dim=-1)
        k_rope = summed_grad(k_rope.reshape(batch, seq_len, 1, self.rope_dim), self.head_group)
        k_rope = apply_rope(k_rope, cos[self.rope_kind], sin[self.rope_kind])
        return self.kv_norm(latent), k_rope

    def expand(
        self, latent: torch.Tensor, k_rope: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (batch, seq, heads, nope + rope) and values (batch, seq, heads, value) of
        the latents and RoPE key parts from ``latent``."""
        batch, seq_len, _ = latent.shape
        kv = self.wkv_b(latent).view(batch, seq_len, -1, self.nope_dim + self.value_dim)
        k_nope, v = kv.split([self.nope_dim, self.value_dim], dim=-1)
        k_rope = k_rope.expand(-1, -1, k_nope.shape[2], -1)
        return torch.cat([k_nope, k_rope], dim=-1), v

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values of x (batch, seq, dim), each (batch, seq, heads,
        width), as Attention.project gives them."""
        k, v = self.expand(*self.latent(x, cos, sin))
        return self.queries(x, cos, sin), k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: LayerMask | CachedKeys = None,
    ) -> torch.Tensor:
        """Attend causally over x (batch, seq, dim) under ``mask`` (as Attention.forward,
        context parallelism and a decoding step's cache included)."""
        batch, seq_len, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        if isinstance(mask, CachedKeys):
            return self.wo(mask.attend(q, k, v).reshape(batch, seq_len, -1))
        split = active_split(self)
        out = attend_heads(q, k, padded_values(v, q.shape[-1], mask, split), mask, split)
        return self.wo(out[..., : self.value_dim].reshape(batch, seq_len, -1))


def padded_values(
    v: torch.Tensor, width: int, mask: LayerMask, split: SequenceSplit | None
) -> torch.Tensor:
    """``v`` padded with zeros to the query/key ``width`` where the kernel needs one
    width: every mask but causality alone (SDPA) and FlexAttention's block masks, and
    every ring. The output's padded channels are zeros, cut by the caller."""
    needs_one_width = (split is not None and split.ring > 1) or not (
        mask is None or isinstance(mask, BlockMask)
    )
    if not needs_one_width or v.shape[-1] == width:
        return v
    return F.pad(v, (0, width - v.shape[-1]))
