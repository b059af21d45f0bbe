"""Gemma 3's text decoder (``Gemma3ForCausalLM``, model_type ``gemma3_text``): our dense
Transformer with four norms per block (model.norm_placement = 'sandwich'), each a
zero-centred RMSNorm (model.zero_centered_norms: the gain is 1 + weight), per-head query and
key norms, a GeGLU feed-forward (model.ffn_activation = 'gelu_tanh'), embeddings times
sqrt(width) (model.embedding_multiplier), logits scaled by query_pre_attn_scalar
(model.attention_scale_size), and sliding-window layers interleaved with global ones, each
kind with its own RoPE: the sliding layers' base rope_local_base_freq, unscaled
(model.rope_local_theta), the global layers' rope_theta with linear scaling at 4B and up
(model.rope_scaling). Its tensors are Llama's names with the sandwich's norms
(tensor_names.BLOCK_NORMS), so only its config.json keys are its own.

config.json comes in two dialects, both read: transformers 5 writes rope_parameters per
layer type; earlier releases (the published checkpoints) write rope_theta,
rope_local_base_freq and rope_scaling (the global layers') at the top. Export writes both.
Soft-capping of attention or final logits (Gemma 2) and bidirectional attention are
refused: no published Gemma 3 uses them.
"""

from __future__ import annotations

import math
from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Architecture, Requirement
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields

DEFAULT_PATTERN = 6
"""Gemma3TextConfig's sliding_window_pattern when a config.json gives no layer_types: every
sixth layer global."""


def _requirement(field: str, holds: Any, allowed: str, why: str) -> Requirement:
    return Requirement(field, holds, f"{allowed} for a Gemma3ForCausalLM export", why)


DENSE = _requirement(
    "num_experts", lambda cfg: not cfg.is_moe, "0", "Gemma 3 has one dense feed-forward per layer"
)
SANDWICH_NORMS = _requirement(
    "norm_placement",
    lambda cfg: cfg.norm_placement == "sandwich",
    "'sandwich'",
    "Gemma 3 normalises each sublayer's input and its output",
)
ZERO_CENTERED = _requirement(
    "zero_centered_norms",
    lambda cfg: cfg.zero_centered_norms,
    "true",
    "Gemma 3's norms scale by 1 + weight",
)
PER_HEAD_QK_NORM = _requirement(
    "qk_norm",
    lambda cfg: cfg.qk_norm == "per_head",
    "'per_head'",
    "Gemma 3 normalises every query and key head",
)
GEGLU = _requirement(
    "ffn_activation",
    lambda cfg: cfg.ffn_activation == "gelu_tanh",
    "'gelu_tanh'",
    "Gemma 3's feed-forward gate is GELU (tanh approximation)",
)
SQRT_WIDTH_EMBEDDING = Requirement(
    "embedding_multiplier",
    lambda cfg: cfg.embedding_multiplier == math.sqrt(cfg.dim),
    lambda cfg: f"sqrt(model.dim) = {math.sqrt(cfg.dim)!r} for a Gemma3ForCausalLM export",
    "Gemma 3 multiplies its embeddings by the square root of the width",
)
LOCAL_ROPE = _requirement(
    "rope_local_theta",
    lambda cfg: cfg.rope_local_theta or cfg.rope_scaling == "none" or not _slides(cfg),
    "a base > 0 when global layers scale RoPE",
    "Gemma 3's sliding layers rotate unscaled by their own base",
)


def _slides(cfg: ModelConfig) -> bool:
    return any(cfg.layer_window(i) for i in range(cfg.n_layers))


def _layer_types(cfg: ModelConfig) -> list[str]:
    return [
        "sliding_attention" if cfg.layer_window(i) else "full_attention"
        for i in range(cfg.n_layers)
    ]


def gemma3_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the Gemma3ForCausalLM equal to our ``cfg``, RoPE in both dialects."""
    local_theta = cfg.rope_local_theta or cfg.rope_theta
    full: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    scaling = None
    if cfg.rope_scaling == "linear":
        scaling = {"rope_type": "linear", "factor": cfg.rope_scaling_factor}
        full.update(scaling)
    return {
        "intermediate_size": cfg.hidden_dim,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": cfg.attention_scale_size or cfg.head_dim,
        "sliding_window": cfg.sliding_window or None,
        "layer_types": _layer_types(cfg),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "rope_local_base_freq": local_theta,
        "rope_scaling": scaling,
        "attention_bias": False,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
    }


def gemma3_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a Gemma3ForCausalLM config.json; refuses what we cannot build."""
    for key, why in (
        ("final_logit_softcapping", "kempnerforge's head does not soft-cap logits"),
        ("attn_logit_softcapping", "kempnerforge's attention does not soft-cap logits"),
    ):
        hf.require(key, None, None, why)
    hf.require("attention_bias", False, False, "kempnerforge's projections have no biases")
    hf.require(
        "use_bidirectional_attention",
        False,
        False,
        "kempnerforge's decoder attends causally",
    )
    activation = hf.data.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise hf.error("hidden_activation", "expected 'gelu_pytorch_tanh' (Gemma 3's GeGLU)")
    hf.get_int("head_dim")
    fields = common_model_fields(
        hf, llama_defaults=False, explicit_head_dim=True, own_activation_and_rope=True
    )
    dim = fields["dim"]
    head_dim = fields["head_size"] or dim // fields["n_heads"]
    scalar = hf.get_int("query_pre_attn_scalar")
    fields.update(
        ffn_hidden_dim=hf.get_int("intermediate_size"),
        tie_embeddings=hf.get_bool("tie_word_embeddings", True),
        norm_placement="sandwich",
        zero_centered_norms=True,
        qk_norm="per_head",
        ffn_activation="gelu_tanh",
        attention_scale_size=None if scalar == head_dim else scalar,
        embedding_multiplier=math.sqrt(dim),
    )
    fields.update(_windows(hf, fields["n_layers"]))
    fields.update(_rope(hf, sliding="sliding_attention" in fields["layer_types"]))
    return fields


def _windows(hf: HFConfig, n_layers: int) -> dict[str, Any]:
    """model.layer_types and model.sliding_window: config.json's layer_types, or its
    sliding_window_pattern (every Nth layer global) when it has none."""
    types = hf.data.get("layer_types")
    if types is None:
        pattern = hf.get_int("sliding_window_pattern", DEFAULT_PATTERN)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
            for i in range(n_layers)
        ]
    if not isinstance(types, list) or len(types) != n_layers:
        raise hf.error("layer_types", f"expected a list of num_hidden_layers = {n_layers} types")
    sliding = "sliding_attention" in types
    window = hf.get_int("sliding_window") if sliding else 0
    if sliding and window < 1:
        raise hf.error("sliding_window", "expected a window of at least 1 token")
    return {"layer_types": types, "sliding_window": window}


def _rope(hf: HFConfig, *, sliding: bool) -> dict[str, Any]:
    """The RoPE fields: the global layers' base and scaling, the sliding layers' base."""
    params = hf.data.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = _rope_params(hf, params.get("full_attention"), "rope_parameters.full_attention")
        local = _rope_params(
            hf, params.get("sliding_attention"), "rope_parameters.sliding_attention"
        )
    else:  # the published checkpoints' keys (transformers 4)
        scaling = hf.data.get("rope_scaling") or {}
        full = {**scaling, "rope_theta": hf.get_float("rope_theta", 1_000_000.0)}
        full = _rope_params(hf, full, "rope_scaling")
        local_theta = hf.get_float("rope_local_base_freq", 10_000.0)
        local = _rope_params(hf, {"rope_theta": local_theta}, "rope_local_base_freq")
    if local["rope_type"] != "default":
        raise hf.error(
            "rope_parameters",
            f"sliding layers' RoPE type {local['rope_type']!r}: expected 'default' "
            "(kempnerforge scales the global layers' RoPE only)",
        )
    fields: dict[str, Any] = {"rope_theta": full["rope_theta"]}
    if full["rope_type"] == "linear":
        fields.update(rope_scaling="linear", rope_scaling_factor=full["factor"])
    if sliding:
        fields["rope_local_theta"] = local["rope_theta"]
    return fields


def _rope_params(hf: HFConfig, params: Any, key: str) -> dict[str, Any]:
    """One layer type's RoPE: its type ('default' or 'linear'), base and factor."""
    if not isinstance(params, dict):
        raise hf.error("rope_parameters", f"{key}: expected a table of RoPE parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "linear"):
        raise hf.error(
            "rope_parameters",
            f"{key}: RoPE type {rope_type!r} is not supported: expected 'default' or 'linear'",
        )
    theta = params.get("rope_theta")
    factor = params.get("factor")
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not theta > 0:
        raise hf.error("rope_parameters", f"{key}: rope_theta {theta!r}: expected a number > 0")
    if rope_type == "linear" and (not isinstance(factor, int | float) or not factor > 0):
        raise hf.error("rope_parameters", f"{key}: factor {factor!r}: expected a number > 0")
    return {"rope_type": rope_type, "rope_theta": float(theta), "factor": factor and float(factor)}


GEMMA3 = Architecture(
    model_type="gemma3_text",
    hf_class="Gemma3ForCausalLM",
    requires=(
        DENSE,
        SANDWICH_NORMS,
        ZERO_CENTERED,
        PER_HEAD_QK_NORM,
        GEGLU,
        SQRT_WIDTH_EMBEDDING,
        LOCAL_ROPE,
    ),
    config_fields=gemma3_config_fields,
    config_keys=gemma3_config_keys,
    own_fields=(
        *("head_size", "qk_norm", "norm_placement", "zero_centered_norms", "ffn_activation"),
        *("attention_scale_size", "embedding_multiplier", "rope_scaling", "rope_scaling_factor"),
        *("rope_local_theta", "sliding_window", "sliding_window_pattern", "layer_types"),
    ),
)
