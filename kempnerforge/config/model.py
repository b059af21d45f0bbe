"""[model]: the shape of the decoder-only Transformer."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kempnerforge.config.checks import MAX_LOSS_WEIGHT, MAX_SIZE, check_at_least, check_positive
from kempnerforge.config.errors import ConfigError


@dataclass
class ModelConfig:
    dim: int = 256
    """Width of the residual stream (hidden size), in channels; 1 to 2**31 - 1."""
    n_layers: int = 4
    """Number of Transformer blocks; 1 to 2**31 - 1."""
    n_heads: int = 4
    """Number of attention (query) heads; must divide dim and give an even head size."""
    n_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; must divide n_heads. None
    means n_heads (plain MHA)."""
    vocab_size: int = 259
    """Rows of the embedding table, in tokens; must be >= the tokenizer's vocabulary (byte
    tokenizer: 259); at most 2**31 - 1."""
    max_seq_len: int = 2048
    """Longest sequence the RoPE tables cover, in tokens; train.seq_len must not exceed it;
    at most 2**31 - 1."""
    rope_theta: float = 10000.0
    """RoPE base frequency (Llama-3 uses 500000); > 0 and at most 1e10."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square inside RMSNorm; > 0 and at most 1."""
    ffn_hidden_dim: int | None = None
    """Explicit SwiGLU hidden size, in channels (1 to 2**31 - 1); None derives it from dim,
    ffn_multiplier and multiple_of."""
    ffn_multiplier: float = 1.0
    """Scales the derived SwiGLU hidden size 8/3 * dim (Llama-3 8B uses 1.3); > 0 and at
    most 16. The derived size must stay at most 2**31 - 1."""
    multiple_of: int = 256
    """The derived SwiGLU hidden size is rounded up to a multiple of this; 1 to 2**31 - 1."""
    tie_embeddings: bool = False
    """Share the token embedding matrix with the output head."""
    init_std: float = 0.02
    """Std of the normal init; output projections are further scaled by 1/sqrt(2 * n_layers).
    > 0 and at most 1."""
    num_experts: int = 0
    """Experts per MoE layer; 0 is a dense model. MoE layers are not available yet."""
    moe_aux_loss_weight: float = 0.01
    """Weight of the MoE load-balancing loss (used only when num_experts > 0); 0 to 1000."""
    moe_router_z_loss_weight: float = 0.0
    """Weight of the MoE router z-loss (used only when num_experts > 0); 0 to 1000."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "max_seq_len", "multiple_of"):
            check_positive(f"model.{name}", getattr(self, name), MAX_SIZE)
        if self.n_kv_heads is not None:
            check_positive("model.n_kv_heads", self.n_kv_heads, MAX_SIZE)
        if self.ffn_hidden_dim is not None:
            check_positive("model.ffn_hidden_dim", self.ffn_hidden_dim, MAX_SIZE)
        # Bases in use stop near 1e7; fp32 computes theta ** x and overflows above ~3e38.
        check_positive("model.rope_theta", self.rope_theta, 1e10)
        # Activations are of unit scale after the norm; an epsilon above 1 swamps them.
        check_positive("model.norm_eps", self.norm_eps, 1.0)
        # Real models use 1 to 1.5; 16 already gives a hidden size of about 43 * dim.
        check_positive("model.ffn_multiplier", self.ffn_multiplier, 16.0)
        # Usual values are 0.006 to 0.02; 1 already makes unit-variance weight matrices.
        check_positive("model.init_std", self.init_std, 1.0)
        check_at_least("model.num_experts", self.num_experts, 0, MAX_SIZE)
        for name in ("moe_aux_loss_weight", "moe_router_z_loss_weight"):
            check_at_least(f"model.{name}", getattr(self, name), 0.0, MAX_LOSS_WEIGHT)
        if self.hidden_dim > MAX_SIZE:
            raise ConfigError(
                "model.dim",
                self.dim,
                "a width whose derived SwiGLU hidden size is at most 2**31 - 1",
                f"dim, ffn_multiplier and multiple_of give {self.hidden_dim}",
            )
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

    def num_params(self) -> int:
        """Exact parameter count of the decoder this config builds, a tied matrix once.

        Counts what kempnerforge.model.transformer creates, without building it: the token
        embedding, per block the bias-free attention projections (wq and wo dim x dim, wk and
        wv dim x kv_heads * head_dim), the three SwiGLU matrices (dim x hidden_dim) and two
        RMSNorm gains, then the final norm and the output head unless tied. Cheap enough to
        size memory at build time before any tensor exists.
        """
        if self.is_moe:
            raise ConfigError(
                "model.num_experts", self.num_experts, "0", "MoE layers are not available yet"
            )
        q_width = self.n_heads * self.head_dim
        kv_width = self.kv_heads * self.head_dim
        attention = 2 * self.dim * q_width + 2 * self.dim * kv_width
        feed_forward = 3 * self.dim * self.hidden_dim
        block = attention + feed_forward + 2 * self.dim
        embedding = self.vocab_size * self.dim
        head = 0 if self.tie_embeddings else self.vocab_size * self.dim
        return embedding + self.n_layers * block + self.dim + head
