"""[model]: the shape of the decoder-only Transformer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kempnerforge.config.checks import check_at_least, check_positive
from kempnerforge.config.errors import ConfigError


@dataclass
class ModelConfig:
    dim: int = 256
    """Width of the residual stream (hidden size)."""
    n_layers: int = 4
    """Number of Transformer blocks."""
    n_heads: int = 4
    """Number of attention (query) heads; must divide dim."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; None means n_heads (plain MHA)."""
    vocab_size: int = 259
    """Rows of the embedding table; must be >= the tokenizer's vocabulary (byte tokenizer: 259)."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables cover; train.seq_len must not exceed it."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama-3 uses 500000)."""
    norm_eps: float = 1e-5
    """Epsilon inside RMSNorm."""
    ffn_hidden_dim: int | None = None
    """Explicit SwiGLU hidden size; None derives it from dim, ffn_multiplier and multiple_of."""
    ffn_multiplier: float = 1.0
    """Scales the derived SwiGLU hidden size (Llama-3 8B uses 1.3)."""
    multiple_of: int = 256
    """The derived SwiGLU hidden size is rounded up to a multiple of this."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output head."""
    init_std: float = 0.02
    """Std of the normal init; output projections are further scaled by 1/sqrt(2 * n_layers)."""
    num_experts: int = 0
    """Experts per MoE layer; 0 is a dense model. MoE layers are not available yet."""
    moe_aux_loss_weight: float = 0.01
    """Weight of the MoE load-balancing loss (used only when num_experts > 0)."""
    moe_router_z_loss_weight: float = 0.0
    """Weight of the MoE router z-loss (used only when num_experts > 0)."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"):
            check_positive(f"model.{name}", getattr(self, name))
        if self.n_kv_heads is not None:
            check_positive("model.n_kv_heads", self.n_kv_heads)
        if self.ffn_hidden_dim is not None:
            check_positive("model.ffn_hidden_dim", self.ffn_hidden_dim)
        check_positive("model.rope_theta", self.rope_theta)
        check_positive("model.norm_eps", self.norm_eps)
        check_positive("model.ffn_multiplier", self.ffn_multiplier)
        check_positive("model.init_std", self.init_std)
        check_at_least("model.num_experts", self.num_experts, 0)
        check_at_least("model.moe_aux_loss_weight", self.moe_aux_loss_weight, 0.0)
        check_at_least("model.moe_router_z_loss_weight", self.moe_router_z_loss_weight, 0.0)
        if self.dim % self.n_heads:
            raise ConfigError("model.n_heads", self.n_heads, f"a divisor of model.dim = {self.dim}")
        if self.n_heads % self.kv_heads:
            raise ConfigError(
                "model.n_kv_heads", self.n_kv_heads, f"a divisor of model.n_heads = {self.n_heads}"
            )
        if (self.dim // self.n_heads) % 2:
            raise ConfigError(
                "model.n_heads",
                self.n_heads,
                "a value giving an even head size (RoPE rotates pairs)",
                f"dim / n_heads = {self.dim // self.n_heads}",
            )

    @property
    def kv_heads(self) -> int:
        """Key/value heads in force (n_kv_heads, or n_heads when unset)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: explicit, or Llama's 2/3 * 4 * dim * multiplier, rounded up."""
        if self.ffn_hidden_dim is not None:
            return self.ffn_hidden_dim
        hidden = int(2 * 4 * self.dim / 3 * self.ffn_multiplier)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def is_moe(self) -> bool:
        """True when blocks use mixture-of-experts feed-forward layers."""
        return self.num_experts > 0
