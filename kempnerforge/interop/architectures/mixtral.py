"""Mixtral (``MixtralForCausalLM``): our softmax-router MoE with top-k >= 2 in every layer and
no shared experts. Mixtral takes a softmax over the router logits, the top k, and
renormalises the gates over the k; its experts are named w1, w3, w2 as ours are, under the
layer's ``block_sparse_moe``."""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Architecture, Requirement
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields
from kempnerforge.interop.architectures.moe_parts import (
    NO_SHARED_EXPERTS,
    OUR_SWIGLU,
    aux_loss_fields,
    every_moe_layer_maps,
    moe_requirement,
    router_requirement,
)

HF_CLASS = "MixtralForCausalLM"
BLOCK = "block_sparse_moe"
"""The MoE block inside a layer, as Mixtral's published checkpoints name it."""


def mixtral_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the Mixtral equal to our MoE ``cfg``."""
    return {
        "intermediate_size": cfg.expert_hidden_dim,
        "num_local_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "sliding_window": None,
    }


def mixtral_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a Mixtral config.json; refuses what we cannot build."""
    fields = common_model_fields(hf, llama_defaults=False)
    k = hf.get_int("num_experts_per_tok")
    if k < 2:
        raise hf.error(
            "num_experts_per_tok",
            "expected >= 2: Mixtral renormalises a single expert's gate to 1, while "
            "kempnerforge's top-1 router keeps the probability",
        )
    fields.update(moe_top_k=k, moe_frequency=1)
    window = hf.data.get("sliding_window")
    if window is not None and window < fields["max_seq_len"]:
        raise hf.error("sliding_window", "expected null: kempnerforge attends to all positions")
    width = hf.get_int("intermediate_size")
    fields.update(num_experts=hf.get_int("num_local_experts"), ffn_hidden_dim=width)
    fields.update(moe_expert_hidden_dim=width, moe_router="softmax")
    return {**fields, **aux_loss_fields(hf)}


mixtral_tensors_to_hf, mixtral_tensors_from_hf = every_moe_layer_maps(BLOCK, OUR_SWIGLU, HF_CLASS)


MIXTRAL = Architecture(
    model_type="mixtral",
    hf_class=HF_CLASS,
    requires=(
        moe_requirement(HF_CLASS),
        router_requirement("softmax", HF_CLASS, "Mixtral's router takes a softmax"),
        NO_SHARED_EXPERTS,
        Requirement(
            "moe_top_k",
            lambda cfg: cfg.moe_top_k >= 2,
            f">= 2 for {HF_CLASS}",
            "Mixtral renormalises a single expert's gate to 1, while kempnerforge's top-1 "
            "router keeps the probability (Qwen2MoeForCausalLM computes it)",
        ),
        Requirement(
            "moe_frequency",
            lambda cfg: cfg.moe_frequency == 1,
            f"1 for {HF_CLASS}",
            "every Mixtral layer is an MoE layer",
        ),
    ),
    config_fields=mixtral_config_fields,
    config_keys=mixtral_config_keys,
    tensors_to_hf=mixtral_tensors_to_hf,
    tensors_from_hf=mixtral_tensors_from_hf,
)
