"""The rules of the [model] fields and the parameter count of the model they build:
ModelConfig (config/model.py) runs check_model on construction and counts with
count_params, so its own module stays the fields and what they derive."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kempnerforge.config.checks import (
    MAX_LAYERS,
    MAX_LOSS_WEIGHT,
    MAX_SIZE,
    check_at_least,
    check_choice,
    check_in_range,
    check_positive,
)
from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.model import ModelConfig

MOE_ROUTERS = ("softmax", "sigmoid")
MOE_AUX_LEVELS = ("token", "sequence")
MOE_BIAS_SCHEDULES = ("constant", "linear_warmup", "cosine_decay")
LAYER_TYPES = ("sliding_attention", "full_attention")
"""model.layer_types' entries, as Hugging Face configs name them."""
QK_NORMS = ("none", "per_head", "projection")
"""model.qk_norm's choices."""
NORM_PLACEMENTS = ("pre", "post", "sandwich")
"""model.norm_placement's choices."""
FFN_ACTIVATIONS = ("silu", "gelu_tanh")
"""model.ffn_activation's choices: the gate's nonlinearity in the gated feed-forward."""
MOE_ACTIVATIONS = ("swiglu", "clamped_swiglu")
"""model.moe_activation's choices."""
ROPE_SCALINGS = ("none", "linear", "yarn")
"""model.rope_scaling's choices."""
MAX_MULTIPLIER = 1e4
"""Largest model.embedding_multiplier: sqrt of a width of 1e8 channels."""


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude m = 0.1 * mscale * ln(factor) + 1 (1 for a factor of at most 1):
    its cos and sin tables' scale, and DeepSeek's attention-logit multiplier's root."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def check_model(cfg: ModelConfig) -> None:
    """Every rule of the [model] fields, each refusal naming its field (ModelConfig
    runs it on construction)."""
    for name in ("dim", "n_heads", "vocab_size", "max_seq_len", "multiple_of"):
        check_positive(f"model.{name}", getattr(cfg, name), MAX_SIZE)
    check_positive("model.n_layers", cfg.n_layers, MAX_LAYERS)
    if cfg.n_kv_heads is not None:
        check_positive("model.n_kv_heads", cfg.n_kv_heads, MAX_SIZE)
    if cfg.ffn_hidden_dim is not None:
        check_positive("model.ffn_hidden_dim", cfg.ffn_hidden_dim, MAX_SIZE)
    # Bases in use stop near 1e7; fp32 computes theta ** x and overflows above ~3e38.
    check_positive("model.rope_theta", cfg.rope_theta, 1e10)
    # Activations are of unit scale after the norm; an epsilon above 1 swamps them.
    check_positive("model.norm_eps", cfg.norm_eps, 1.0)
    # Real models use 1 to 1.5; 16 already gives a hidden size of about 43 * dim.
    check_positive("model.ffn_multiplier", cfg.ffn_multiplier, 16.0)
    # Usual values are 0.006 to 0.02; 1 already makes unit-variance weight matrices.
    check_positive("model.init_std", cfg.init_std, 1.0)
    check_at_least("model.num_experts", cfg.num_experts, 0, MAX_SIZE)
    check_at_least("model.mtp_depth", cfg.mtp_depth, 0, MAX_SIZE)
    for name in ("moe_aux_loss_weight", "moe_router_z_loss_weight", "mtp_loss_weight"):
        check_at_least(f"model.{name}", getattr(cfg, name), 0.0, MAX_LOSS_WEIGHT)
    check_moe(cfg)
    check_windows(cfg)
    if cfg.hidden_dim > MAX_SIZE:
        raise ConfigError(
            "model.dim",
            cfg.dim,
            "a width whose derived SwiGLU hidden size is at most 2**31 - 1",
            f"dim, ffn_multiplier and multiple_of give {cfg.hidden_dim}",
        )
    if cfg.n_heads % cfg.kv_heads:
        raise ConfigError(
            "model.n_kv_heads", cfg.n_kv_heads, f"a divisor of model.n_heads = {cfg.n_heads}"
        )
    check_heads(cfg)
    check_choice("model.qk_norm", cfg.qk_norm, QK_NORMS)
    check_choice("model.norm_placement", cfg.norm_placement, NORM_PLACEMENTS)
    check_gemma_options(cfg)
    check_latent_attention(cfg)


def check_latent_attention(cfg: ModelConfig) -> None:
    """Rules of multi-head latent attention: every model.mla_* field 0 without it;
    with it, sizes that make heads, and none of the standard attention's options."""
    sizes = ("mla_q_rank", "mla_nope_head_size", "mla_rope_head_size", "mla_value_head_size")
    check_at_least("model.mla_kv_rank", cfg.mla_kv_rank, 0, MAX_SIZE)
    if not cfg.is_mla:
        for name in sizes:
            if getattr(cfg, name):
                raise ConfigError(
                    f"model.{name}",
                    getattr(cfg, name),
                    "0 when model.mla_kv_rank is 0",
                    "it sizes multi-head latent attention: set model.mla_kv_rank",
                )
        return
    for name in sizes[:2]:
        check_at_least(f"model.{name}", getattr(cfg, name), 0, MAX_SIZE)
    for name in sizes[2:]:
        check_positive(f"model.{name}", getattr(cfg, name), MAX_SIZE)
    if cfg.mla_rope_head_size % 2:
        raise ConfigError(
            "model.mla_rope_head_size",
            cfg.mla_rope_head_size,
            "an even size (RoPE rotates pairs)",
        )
    if cfg.mla_value_head_size > cfg.qk_head_dim:
        raise ConfigError(
            "model.mla_value_head_size",
            cfg.mla_value_head_size,
            f"<= mla_nope_head_size + mla_rope_head_size = {cfg.qk_head_dim}",
            "kernels that need equal widths pad the values to the query/key width",
        )
    if cfg.kv_heads != cfg.n_heads:
        raise ConfigError(
            "model.n_kv_heads",
            cfg.n_kv_heads,
            f"unset or model.n_heads = {cfg.n_heads} with multi-head latent attention",
            "latent attention decompresses a key and a value head per query head",
        )
    standard = (
        ("head_size", None),
        ("qk_norm", "none"),
        ("attention_bias", False),
        ("attention_sinks", False),
        ("attention_scale_size", None),
    )
    for name, unset in standard:
        if getattr(cfg, name) != unset:
            raise ConfigError(
                f"model.{name}",
                getattr(cfg, name),
                f"{unset!r} with multi-head latent attention (model.mla_kv_rank > 0)",
                "latent attention has a key and value head per query head, sized by "
                "the model.mla_* fields, and none of the standard attention's options",
            )


def check_gemma_options(cfg: ModelConfig) -> None:
    """Rules of the activation, attention scale, embedding multiplier and RoPE fields
    (Gemma 3's, and RoPE scaling)."""
    check_choice("model.ffn_activation", cfg.ffn_activation, FFN_ACTIVATIONS)
    if cfg.is_moe and cfg.ffn_activation != "silu":
        raise ConfigError(
            "model.ffn_activation",
            cfg.ffn_activation,
            "'silu' for an MoE model (model.num_experts > 0)",
            "the experts compute SwiGLU; a GeGLU applies to dense models only",
        )
    if cfg.attention_scale_size is not None:
        check_positive("model.attention_scale_size", cfg.attention_scale_size, MAX_SIZE)
    check_positive("model.embedding_multiplier", cfg.embedding_multiplier, MAX_MULTIPLIER)
    check_rope_scaling(cfg)
    check_at_least("model.rope_local_theta", cfg.rope_local_theta, 0.0, 1e10)
    sliding = any(cfg.layer_window(i) for i in range(cfg.n_layers))
    if cfg.rope_local_theta and not sliding:
        raise ConfigError(
            "model.rope_local_theta",
            cfg.rope_local_theta,
            "0 when no layer slides",
            "it is the RoPE base of the sliding-window layers: set model.sliding_window",
        )


def check_heads(cfg: ModelConfig) -> None:
    """The head size: explicit and even, or derived from a width n_heads divides into
    even heads."""
    if cfg.head_size is not None:
        check_positive("model.head_size", cfg.head_size, MAX_SIZE)
        if cfg.head_size % 2:
            raise ConfigError("model.head_size", cfg.head_size, "an even size (RoPE rotates pairs)")
        return
    if cfg.dim % cfg.n_heads:
        raise ConfigError(
            "model.n_heads",
            cfg.n_heads,
            f"a divisor of model.dim = {cfg.dim}",
            "or set model.head_size",
        )
    if (cfg.dim // cfg.n_heads) % 2:
        raise ConfigError(
            "model.n_heads",
            cfg.n_heads,
            "a value giving an even head size (RoPE rotates pairs)",
            f"dim / n_heads = {cfg.dim // cfg.n_heads}",
        )


def check_moe(cfg: ModelConfig) -> None:
    """Rules of the MoE fields: ranges always, the top-k against the experts when
    num_experts > 0."""
    check_positive("model.moe_top_k", cfg.moe_top_k, MAX_SIZE)
    if cfg.is_moe and cfg.moe_top_k > cfg.num_experts:
        raise ConfigError(
            "model.moe_top_k",
            cfg.moe_top_k,
            f"<= model.num_experts = {cfg.num_experts}",
            "a token cannot go to more experts than exist",
        )
    check_positive("model.moe_frequency", cfg.moe_frequency, cfg.n_layers)
    check_choice("model.moe_router", cfg.moe_router, MOE_ROUTERS)
    check_at_least("model.moe_shared_experts", cfg.moe_shared_experts, 0, 64)
    if cfg.moe_expert_hidden_dim is not None:
        check_positive("model.moe_expert_hidden_dim", cfg.moe_expert_hidden_dim, MAX_SIZE)
    if cfg.moe_capacity_factor is not None:
        # 64 already keeps every token when top_k <= 64 experts share a micro-batch.
        check_positive("model.moe_capacity_factor", cfg.moe_capacity_factor, 64.0)
    check_choice("model.moe_aux_loss_level", cfg.moe_aux_loss_level, MOE_AUX_LEVELS)
    check_at_least("model.moe_bias_update_rate", cfg.moe_bias_update_rate, 0.0, 1.0)
    check_choice("model.moe_bias_schedule", cfg.moe_bias_schedule, MOE_BIAS_SCHEDULES)
    check_choice("model.moe_activation", cfg.moe_activation, MOE_ACTIVATIONS)
    check_positive("model.moe_swiglu_limit", cfg.moe_swiglu_limit, 1e6)
    check_positive("model.moe_swiglu_alpha", cfg.moe_swiglu_alpha, 1e3)
    check_positive("model.moe_routed_scaling", cfg.moe_routed_scaling, 1e3)
    check_at_least("model.moe_first_dense_layers", cfg.moe_first_dense_layers, 0, cfg.n_layers - 1)
    check_expert_groups(cfg)


def check_expert_groups(cfg: ModelConfig) -> None:
    """Group-limited routing: groups that cut the experts evenly, 2 or more each, a
    sigmoid router, and kept groups that hold the top k."""
    groups, kept = cfg.moe_num_groups, cfg.moe_top_groups
    check_positive("model.moe_num_groups", groups, MAX_SIZE)
    check_positive("model.moe_top_groups", kept, groups)
    if groups == 1:
        return
    if cfg.moe_router != "sigmoid":
        raise ConfigError(
            "model.moe_num_groups",
            groups,
            "1 with the softmax router",
            "group-limited routing ranks the sigmoid router's biased scores",
        )
    if cfg.num_experts % groups or cfg.num_experts // groups < 2:
        raise ConfigError(
            "model.moe_num_groups",
            groups,
            f"a divisor of model.num_experts = {cfg.num_experts} leaving >= 2 experts a group",
            "a group is ranked by the sum of its two best scores",
        )
    if cfg.moe_top_k > kept * (cfg.num_experts // groups):
        raise ConfigError(
            "model.moe_top_groups",
            kept,
            f"groups holding >= model.moe_top_k = {cfg.moe_top_k} experts",
            "a token chooses its top k within the groups kept",
        )


def check_windows(cfg: ModelConfig) -> None:
    """Rules of the sliding-window fields: a window that some layer uses, chosen by
    the pattern or by the per-layer list, not both."""
    check_at_least("model.sliding_window", cfg.sliding_window, 0, MAX_SIZE)
    pattern = cfg.sliding_window_pattern
    if pattern and not 2 <= pattern <= cfg.n_layers:
        raise ConfigError(
            "model.sliding_window_pattern",
            pattern,
            f"0 (every layer slides) or 2 to model.n_layers = {cfg.n_layers}",
        )
    if cfg.layer_types:
        check_layer_types(cfg)
    elif pattern and not cfg.sliding_window:
        raise ConfigError(
            "model.sliding_window_pattern",
            pattern,
            "0 when model.sliding_window is 0",
            "set model.sliding_window to the window's length in tokens",
        )


def check_rope_scaling(cfg: ModelConfig) -> None:
    """Rules of RoPE scaling: its parameters at their defaults without it, and a
    factor, an original length and a ramp that mean something with it."""
    check_choice("model.rope_scaling", cfg.rope_scaling, ROPE_SCALINGS)
    # Bounded whatever the scaling, so no value beyond float32 passes unread.
    check_positive("model.rope_yarn_beta_fast", cfg.rope_yarn_beta_fast, 1e6)
    check_positive("model.rope_yarn_beta_slow", cfg.rope_yarn_beta_slow, 1e6)
    if cfg.rope_scaling != "yarn":
        for name in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
            if getattr(cfg, name):
                raise ConfigError(
                    f"model.{name}",
                    getattr(cfg, name),
                    "0 unless model.rope_scaling is 'yarn'",
                    "it scales YaRN's attention",
                )
    if cfg.rope_scaling == "none":
        for name, unset in (("rope_scaling_factor", 1.0), ("rope_original_max_seq_len", 0)):
            if getattr(cfg, name) != unset:
                raise ConfigError(
                    f"model.{name}",
                    getattr(cfg, name),
                    f"{unset!r} when model.rope_scaling is 'none'",
                    "set model.rope_scaling to the scaling it belongs to",
                )
        return
    check_in_range("model.rope_scaling_factor", cfg.rope_scaling_factor, 1.0, 1e4)
    if cfg.rope_scaling != "yarn":
        if cfg.rope_original_max_seq_len:
            raise ConfigError(
                "model.rope_original_max_seq_len",
                cfg.rope_original_max_seq_len,
                f"0 when model.rope_scaling is {cfg.rope_scaling!r}",
                "only YaRN reads the original length",
            )
        return
    check_positive("model.rope_original_max_seq_len", cfg.rope_original_max_seq_len, MAX_SIZE)
    for name in ("rope_yarn_mscale", "rope_yarn_mscale_all_dim"):
        check_at_least(f"model.{name}", getattr(cfg, name), 0.0, 1e3)
    if cfg.rope_yarn_beta_slow >= cfg.rope_yarn_beta_fast:
        raise ConfigError(
            "model.rope_yarn_beta_slow",
            cfg.rope_yarn_beta_slow,
            f"< model.rope_yarn_beta_fast = {cfg.rope_yarn_beta_fast}",
            "the ramp runs from the fast rotations down to the slow ones",
        )


def check_layer_types(cfg: ModelConfig) -> None:
    types = cfg.layer_types
    if len(types) != cfg.n_layers:
        raise ConfigError(
            "model.layer_types",
            types,
            f"one entry per layer (model.n_layers = {cfg.n_layers}), or []",
        )
    for i, kind in enumerate(types):
        check_choice(f"model.layer_types[{i}]", kind, LAYER_TYPES)
    if cfg.sliding_window_pattern:
        raise ConfigError(
            "model.sliding_window_pattern",
            cfg.sliding_window_pattern,
            "0 when model.layer_types is given",
            "model.layer_types names each layer's attention itself",
        )
    sliding = "sliding_attention" in types
    if sliding != bool(cfg.sliding_window):
        raise ConfigError(
            "model.sliding_window",
            cfg.sliding_window,
            "a window > 0" if sliding else "0 when no layer is 'sliding_attention'",
            "model.layer_types names sliding layers"
            if sliding
            else "no layer of model.layer_types uses the window",
        )


def latent_attention_params(cfg: ModelConfig) -> int:
    """One MLA block's attention: the queries' projection (or its two with the latent
    norm between), the key/value latent projection with the shared RoPE key part, the
    latent norm, the decompression to each head's key and value, the output."""
    heads, qk = cfg.n_heads, cfg.qk_head_dim
    if cfg.mla_q_rank:
        queries = cfg.dim * cfg.mla_q_rank + cfg.mla_q_rank + cfg.mla_q_rank * heads * qk
    else:
        queries = cfg.dim * heads * qk
    latent = cfg.dim * (cfg.mla_kv_rank + cfg.mla_rope_head_size) + cfg.mla_kv_rank
    expand = cfg.mla_kv_rank * heads * (cfg.mla_nope_head_size + cfg.mla_value_head_size)
    return queries + latent + expand + heads * cfg.mla_value_head_size * cfg.dim


def count_params(cfg: ModelConfig, *, active: bool) -> int:
    q_width = cfg.n_heads * cfg.head_dim
    kv_width = cfg.kv_heads * cfg.head_dim
    attention = 2 * cfg.dim * q_width + 2 * cfg.dim * kv_width
    if cfg.is_mla:
        attention = latent_attention_params(cfg)
    if cfg.attention_bias:
        attention += q_width + 2 * kv_width + cfg.dim
    if cfg.attention_sinks:
        attention += cfg.n_heads
    if cfg.qk_norm == "per_head":
        attention += 2 * cfg.head_dim
    elif cfg.qk_norm == "projection":
        attention += q_width + kv_width
    dense_ffn = 3 * cfg.dim * cfg.hidden_dim
    expert = 3 * cfg.dim * cfg.expert_hidden_dim
    routed = cfg.moe_top_k if active else cfg.num_experts
    moe_ffn = cfg.dim * cfg.num_experts + (routed + cfg.moe_shared_experts) * expert
    if cfg.moe_router_bias:
        moe_ffn += cfg.num_experts
    if cfg.moe_expert_bias:
        moe_ffn += routed * (2 * cfg.expert_hidden_dim + cfg.dim)

    def block(index: int) -> int:
        ffn = moe_ffn if cfg.is_moe_layer(index) else dense_ffn
        return attention + ffn + cfg.block_norms * cfg.dim

    blocks = sum(block(index) for index in range(cfg.n_layers))
    # A multi-token-prediction module: a block built as the last one, its two input norms
    # and projection from 2 * dim, and its head's norm (embedding and head are shared).
    blocks += cfg.mtp_depth * (block(cfg.n_layers - 1) + 2 * cfg.dim * cfg.dim + 3 * cfg.dim)
    embedding = cfg.vocab_size * cfg.dim
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim
    return embedding + blocks + cfg.dim + head
