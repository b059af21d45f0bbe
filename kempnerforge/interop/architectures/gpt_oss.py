"""GPT-OSS (``GptOssForCausalLM``): grouped-query attention with biases on the four
projections (model.attention_bias), a learned sink logit per query head
(model.attention_sinks), windowed and full layers by config.json's layer_types
(model.layer_types and model.sliding_window), YaRN RoPE (model.rope_scaling) and a head
size of its own, over an MoE in every layer.

Its router is a biased linear map (model.moe_router_bias), the top k of its logits, and a
softmax over those k: our softmax router's renormalised top k, which equals it for k > 1
(for k = 1 ours keeps the probability, so k >= 2 is required). Its experts have biases
(model.moe_expert_bias) and the clamped SwiGLU (model.moe_activation 'clamped_swiglu',
swiglu_limit and swiglu_alpha); they are stored as three tensors for all experts: the
gate and up projections interleaved along the last dimension of gate_up_proj (experts,
hidden, 2 * expert width; gate = [..., 0::2], up = [..., 1::2], and so their biases),
and down_proj (experts, expert width, hidden), which is our (experts, in, out) layout,
so nothing is transposed. The published checkpoints hold the experts in MXFP4 blocks
and scales, which import_hf turns back into the tensors above before this module reads
them (interop/mxfp4.py), as a folder saved by transformers in a float dtype holds them.
"""

from __future__ import annotations

from typing import Any

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import (
    Architecture,
    Requirement,
    Shapes,
    State,
)
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields
from kempnerforge.interop.architectures.moe_parts import (
    NO_SHARED_EXPERTS,
    aux_loss_fields,
    moe_layers,
    moe_requirement,
    router_requirement,
)
from kempnerforge.interop.architectures.tensor_names import HFTensors, shared_pairs

HF_CLASS = "GptOssForCausalLM"
SWIGLU_ALPHA = 1.702
"""GptOssConfig's swiglu_alpha when config.json leaves it out (older releases fix it)."""


def _needs(field: str, value: Any, why: str) -> Requirement:
    return Requirement(
        field, lambda cfg: getattr(cfg, field) == value, f"{value!r} for {HF_CLASS}", why
    )


REQUIREMENTS = (
    moe_requirement(HF_CLASS),
    router_requirement("softmax", HF_CLASS, "GPT-OSS's router takes a softmax over its top k"),
    NO_SHARED_EXPERTS,
    Requirement(
        "moe_top_k",
        lambda cfg: cfg.moe_top_k >= 2,
        f">= 2 for {HF_CLASS}",
        "GPT-OSS's softmax over a single chosen logit gives it weight 1, while "
        "kempnerforge's top-1 router keeps the probability",
    ),
    Requirement(
        "moe_frequency",
        lambda cfg: cfg.moe_frequency == 1,
        f"1 for {HF_CLASS}",
        "every GPT-OSS layer is an MoE layer",
    ),
    _needs("moe_activation", "clamped_swiglu", "GPT-OSS's experts clamp their SwiGLU"),
    _needs("moe_router_bias", True, "GPT-OSS's router has a bias"),
    _needs("moe_expert_bias", True, "GPT-OSS's experts have biases"),
    _needs("attention_sinks", True, "GPT-OSS's attention has a sink per head"),
)
"""What a GptOssForCausalLM export needs of our config, broadest first."""


def gpt_oss_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the GptOssForCausalLM equal to our ``cfg``: each layer's
    attention written out (layer_types), the window null when no layer slides."""
    layer_types = [
        "sliding_attention" if cfg.layer_window(i) else "full_attention"
        for i in range(cfg.n_layers)
    ]
    return {
        "intermediate_size": cfg.expert_hidden_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "swiglu_limit": cfg.moe_swiglu_limit,
        "swiglu_alpha": cfg.moe_swiglu_alpha,
        "attention_bias": cfg.attention_bias,
        "sliding_window": cfg.sliding_window or None,
        "layer_types": layer_types,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        "output_router_logits": False,
    }


def gpt_oss_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a GptOssForCausalLM config.json; refuses what we cannot build.

    An absent layer_types is the class's alternation (even layers slide); an absent
    sliding_window is the class's 128, null none."""
    fields = common_model_fields(
        hf, llama_defaults=False, explicit_head_dim=True, rope_scalings=("yarn",)
    )
    k = hf.get_int("num_experts_per_tok")
    if k < 2:
        raise hf.error(
            "num_experts_per_tok",
            "expected >= 2: GPT-OSS gives a single chosen expert weight 1, while "
            "kempnerforge's top-1 router keeps the probability",
        )
    width = hf.get_int("intermediate_size")
    fields.update(moe_top_k=k, moe_frequency=1, moe_router="softmax")
    fields.update(num_experts=hf.get_int("num_local_experts"), ffn_hidden_dim=width)
    fields.update(moe_expert_hidden_dim=width, moe_activation="clamped_swiglu")
    fields["moe_swiglu_limit"] = hf.get_float("swiglu_limit", 7.0)
    fields["moe_swiglu_alpha"] = hf.get_float("swiglu_alpha", SWIGLU_ALPHA)
    fields.update(moe_router_bias=True, moe_expert_bias=True, attention_sinks=True)
    fields["attention_bias"] = hf.get_bool("attention_bias", True)
    fields.update(_windows(hf, fields["n_layers"]))
    return {**fields, **aux_loss_fields(hf)}


def _windows(hf: HFConfig, n_layers: int) -> dict[str, Any]:
    """model.layer_types and model.sliding_window of config.json (GptOssConfig's defaults
    where absent)."""
    layer_types = hf.data.get("layer_types")
    if layer_types is None:
        layer_types = [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)
        ]
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        raise hf.error("layer_types", f"expected a list of {n_layers} layer types")
    for kind in layer_types:
        if kind not in ("sliding_attention", "full_attention"):
            raise hf.error(
                "layer_types", f"{kind!r}: expected 'sliding_attention' or 'full_attention'"
            )
    window = hf.data.get("sliding_window", 128)
    sliding = "sliding_attention" in layer_types
    if window is None or not sliding:
        return {"layer_types": ["full_attention"] * n_layers, "sliding_window": 0}
    window = hf.get_int("sliding_window", 128)
    if window < 1:
        raise hf.error("sliding_window", "expected a window of at least 1 token, or null")
    return {"layer_types": layer_types, "sliding_window": window}


def attention_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, its name) of every tensor copied as it is: Llama's names, the
    projections' biases, the sinks, the router and the down projections and biases."""
    pairs = shared_pairs(cfg)
    for index in range(cfg.n_layers):
        ours, hf = f"layers.{index}.", f"model.layers.{index}."
        if cfg.attention_bias:
            pairs += [
                (f"{ours}attention.w{p}.bias", f"{hf}self_attn.{p}_proj.bias") for p in "qkvo"
            ]
        pairs.append((f"{ours}attention.sinks", f"{hf}self_attn.sinks"))
    for index in moe_layers(cfg):
        ours, hf = f"layers.{index}.feed_forward.", f"model.layers.{index}.mlp."
        pairs += [
            (f"{ours}router.gate.weight", f"{hf}router.weight"),
            (f"{ours}router.gate.bias", f"{hf}router.bias"),
            (f"{ours}experts.w2", f"{hf}experts.down_proj"),
            (f"{ours}experts.b2", f"{hf}experts.down_proj_bias"),
        ]
    return pairs


def interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate and up (..., width) as one (..., 2 * width): gate at even, up at odd places."""
    return torch.stack([gate, up], dim=-1).flatten(-2)


def gpt_oss_tensors_to_hf(state: State, cfg: ModelConfig) -> State:
    """Each MoE layer's gate and up projections and biases, interleaved."""
    out: State = {}
    for index in moe_layers(cfg):
        ours, hf = f"layers.{index}.feed_forward.experts.", f"model.layers.{index}.mlp.experts."
        out[f"{hf}gate_up_proj"] = interleave(state[f"{ours}w1"], state[f"{ours}w3"])
        out[f"{hf}gate_up_proj_bias"] = interleave(state[f"{ours}b1"], state[f"{ours}b3"])
    return out


def gpt_oss_tensors_from_hf(
    source: HFTensors, hf: HFConfig, cfg: ModelConfig, shapes: Shapes
) -> State:
    """Our gate and up projections and biases from each layer's interleaved ones."""
    del hf
    state: State = {}
    for index in moe_layers(cfg):
        ours, theirs = f"layers.{index}.feed_forward.experts.", f"model.layers.{index}.mlp."
        experts, dim, width = shapes[f"{ours}w1"]
        both = source.take(f"{theirs}experts.gate_up_proj", (experts, dim, 2 * width))
        state[f"{ours}w1"] = both[..., 0::2].contiguous()
        state[f"{ours}w3"] = both[..., 1::2].contiguous()
        bias = source.take(f"{theirs}experts.gate_up_proj_bias", (experts, 2 * width))
        state[f"{ours}b1"] = bias[..., 0::2].contiguous()
        state[f"{ours}b3"] = bias[..., 1::2].contiguous()
    return state


GPT_OSS = Architecture(
    model_type="gpt_oss",
    hf_class=HF_CLASS,
    requires=REQUIREMENTS,
    config_fields=gpt_oss_config_fields,
    config_keys=gpt_oss_config_keys,
    own_fields=(
        *("head_size", "sliding_window", "sliding_window_pattern", "layer_types"),
        *("attention_sinks", "attention_bias", "moe_router_bias", "moe_expert_bias"),
        *("moe_activation", "moe_swiglu_limit", "moe_swiglu_alpha"),
        *("rope_scaling", "rope_scaling_factor", "rope_original_max_seq_len"),
        *("rope_yarn_beta_fast", "rope_yarn_beta_slow", "rope_yarn_truncate"),
    ),
    renamed=attention_pairs,
    tensors_to_hf=gpt_oss_tensors_to_hf,
    tensors_from_hf=gpt_oss_tensors_from_hf,
)
