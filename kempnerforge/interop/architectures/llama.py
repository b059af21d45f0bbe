"""Llama (``LlamaForCausalLM``): our dense Transformer. Every tensor has Llama's shared name
(tensor_names), so only its config.json keys are its own."""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Architecture, Requirement
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields

DENSE = Requirement(
    "num_experts",
    lambda cfg: not cfg.is_moe,
    "0 for a LlamaForCausalLM export",
    "an MoE model is written by export_hf as the MoE class that matches its router",
)
"""A Llama has one dense feed-forward per layer."""


def llama_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the LlamaForCausalLM equal to our dense model ``cfg``."""
    return {
        "intermediate_size": cfg.hidden_dim,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def llama_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a LlamaForCausalLM config.json; refuses what we cannot build.
    An absent key takes Llama's long-standing default (common_model_fields)."""
    why = "kempnerforge's projections have no biases"
    hf.require("attention_bias", False, False, why)
    hf.require("mlp_bias", False, False, why)
    fields = common_model_fields(hf, llama_defaults=True)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    return fields


LLAMA = Architecture(
    model_type="llama",
    hf_class="LlamaForCausalLM",
    requires=(DENSE,),
    config_fields=llama_config_fields,
    config_keys=llama_config_keys,
)
