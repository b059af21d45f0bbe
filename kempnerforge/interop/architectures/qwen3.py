"""Qwen3 (``Qwen3ForCausalLM``): our dense Transformer with an RMSNorm on each query and key
head before RoPE (model.qk_norm = 'per_head') and a head size of its own (model.head_size:
128 at every published width). Its tensors are Llama's names plus self_attn.q_norm and
k_norm (tensor_names), so only its config.json keys are its own."""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Architecture, Requirement
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields

DENSE = Requirement(
    "num_experts",
    lambda cfg: not cfg.is_moe,
    "0 for a Qwen3ForCausalLM export",
    "Qwen3 has one dense feed-forward per layer",
)
PER_HEAD_QK_NORM = Requirement(
    "qk_norm",
    lambda cfg: cfg.qk_norm == "per_head",
    "'per_head' for a Qwen3ForCausalLM export",
    "Qwen3 normalises every query and key head; without it the model is a Llama",
)


def qwen3_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the Qwen3ForCausalLM equal to our ``cfg``: no sliding window
    (Qwen3 reads use_sliding_window, its window and max_window_layers only together)."""
    return {
        "intermediate_size": cfg.hidden_dim,
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }


def qwen3_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a Qwen3ForCausalLM config.json; refuses what we cannot build.
    head_dim is required: the class's default (128) is not the width's share."""
    hf.require("attention_bias", False, False, "kempnerforge's projections have no biases")
    hf.require(
        "use_sliding_window",
        False,
        False,
        "every published Qwen3 attends to the whole past; kempnerforge reads its windows "
        "only from a Mistral or a model.layer_types config",
    )
    hf.get_int("head_dim")
    fields = common_model_fields(hf, llama_defaults=False, explicit_head_dim=True)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    fields["qk_norm"] = "per_head"
    return fields


QWEN3 = Architecture(
    model_type="qwen3",
    hf_class="Qwen3ForCausalLM",
    requires=(DENSE, PER_HEAD_QK_NORM),
    config_fields=qwen3_config_fields,
    config_keys=qwen3_config_keys,
    own_fields=("head_size", "qk_norm"),
)
