"""Gated cross-attention: text queries attend to image tokens, through zero-initialised
gates, so a decoder with these blocks inserted starts as the text-only decoder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.mlp import SwiGLU
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.weight_init import fill_parameter, init_std, parameter_seed, zero_parameter


class CrossAttention(nn.Module):
    """Grouped-query attention of queries from ``x`` over keys and values from ``context``.

    No RoPE and no mask: every text position sees every image token, and the image tokens
    carry their own positions (the encoder's position embeddings). Query head h reads
    key/value head h // (n_heads / n_kv_heads), as in the decoder's Attention.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        """Channels per head."""
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        """Query projection of the text stream."""
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        """Key projection of the image tokens (kv_heads heads)."""
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * cfg.head_dim, bias=False)
        """Value projection of the image tokens (kv_heads heads)."""
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        """Output projection into the residual stream; its init is depth-scaled."""

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """x (batch, seq, dim) attends to context (batch, tokens, dim) -> (batch, seq, dim)."""
        batch, seq_len, _ = x.shape
        q = self.wq(x).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
        k = self.wk(context).view(batch, context.shape[1], -1, self.head_dim).transpose(1, 2)
        v = self.wv(context).view(batch, context.shape[1], -1, self.head_dim).transpose(1, 2)
        grouped = q.shape[1] != k.shape[1]
        out = F.scaled_dot_product_attention(q, k, v, enable_gqa=grouped)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class GatedCrossAttentionBlock(nn.Module):
    """h + tanh(gate_attn) * cross_attention(norm(h), norm(image)), then
    + tanh(gate_ffn) * feed_forward(norm(h)).

    Both gates start at zero, so at init the block returns its input exactly and the model
    is the text-only decoder; training opens the gates as the image becomes useful. The
    image tokens get a norm of their own because the adapter's output has no fixed scale.
    The gates have one element (not zero dimensions) so FSDP can shard them like any
    other parameter.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        """The decoder's shape, which this block shares."""
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        """Normalizes the text queries."""
        self.context_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        """Normalizes the image tokens the keys and values are computed from."""
        self.attention = CrossAttention(cfg)
        """Text-to-image attention."""
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        """Normalizes the feed-forward input."""
        self.feed_forward = SwiGLU(cfg.dim, cfg.hidden_dim)
        """SwiGLU feed-forward of the decoder's size."""
        self.gate_attn = nn.Parameter(torch.zeros(1))
        """Scales the attention's output by tanh(gate_attn); zero at init."""
        self.gate_ffn = nn.Parameter(torch.zeros(1))
        """Scales the feed-forward's output by tanh(gate_ffn); zero at init."""

    def forward(self, h: torch.Tensor, image: torch.Tensor) -> torch.Tensor:
        """h (batch, seq, dim) with image tokens (batch, tokens, dim) -> (batch, seq, dim)."""
        attended = self.attention(self.attention_norm(h), self.context_norm(image))
        h = h + torch.tanh(self.gate_attn) * attended
        return h + torch.tanh(self.gate_ffn) * self.feed_forward(self.ffn_norm(h))

    @torch.no_grad()
    def init_weights(self, seed: int, prefix: str = "") -> None:
        """Gates zero; the rest like a decoder block (init_std, depth-scaled output
        projections, unit norm gains), each drawn from ``seed`` and ``prefix`` + name."""
        for name, param in self.named_parameters():
            if name.startswith("gate_"):
                zero_parameter(param)
            else:
                fill_parameter(param, init_std(self.cfg, name), parameter_seed(seed, prefix + name))
