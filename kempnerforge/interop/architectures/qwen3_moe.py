"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (an RMSNorm on each query and key
head before RoPE, model.qk_norm = 'per_head', and config.json's head_dim as model.head_size)
over our softmax-router MoE without shared experts.

Its router is ours: a softmax over the expert logits in fp32, the top k, and the k gates
renormalised to sum 1 when ``norm_topk_prob``; ours renormalises exactly when k > 1, so
norm_topk_prob = (k > 1), as for Qwen2-MoE (every published size routes 8 of 128 with it
true). decoder_sparse_step is our moe_frequency (block i is MoE when (i + 1) % N == 0) and
its dense blocks' width, intermediate_size, our ffn_hidden_dim. Unlike Qwen2-MoE it has no
shared expert and no q/k/v biases, so every tensor is a copy or one expert's matrix.
"""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import (
    Architecture,
    Requirement,
)
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields
from kempnerforge.interop.architectures.moe_parts import (
    NO_SHARED_EXPERTS,
    aux_loss_fields,
    every_moe_layer_maps,
    moe_requirement,
    renormalised_top_k,
    router_requirement,
)

HF_CLASS = "Qwen3MoeForCausalLM"
BLOCK = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
"""Its names of an expert's gate, up and down projections (our w1, w3, w2)."""

PER_HEAD_QK_NORM = Requirement(
    "qk_norm",
    lambda cfg: cfg.qk_norm == "per_head",
    f"'per_head' for a {HF_CLASS} export",
    "Qwen3-MoE normalises every query and key head; without it the model is a Qwen2-MoE "
    "or a Mixtral",
)


def qwen3_moe_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the Qwen3-MoE equal to our MoE ``cfg``: its MoE layers placed by
    decoder_sparse_step alone (no mlp_only_layers) and no sliding window."""
    return {
        "intermediate_size": cfg.hidden_dim,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "norm_topk_prob": cfg.moe_top_k > 1,
        "decoder_sparse_step": cfg.moe_frequency,
        "mlp_only_layers": [],
        "attention_bias": False,
        "use_sliding_window": False,
        "sliding_window": None,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        "output_router_logits": False,
    }


def qwen3_moe_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a Qwen3-MoE config.json; refuses what we cannot build. Its
    attention reads head_dim when present and hidden_size / num_attention_heads otherwise."""
    hf.require("attention_bias", False, False, "kempnerforge's projections have no biases")
    hf.require(
        "use_sliding_window",
        False,
        False,
        "every published Qwen3-MoE attends to the whole past; kempnerforge reads its "
        "windows only from a Mistral or a model.layer_types config",
    )
    if hf.data.get("mlp_only_layers"):
        raise hf.error(
            "mlp_only_layers",
            "expected []: kempnerforge places dense layers by model.moe_frequency "
            "(decoder_sparse_step) alone",
        )
    fields = common_model_fields(hf, llama_defaults=False, explicit_head_dim=True)
    fields["moe_top_k"] = renormalised_top_k(hf)
    fields["moe_frequency"] = hf.get_int("decoder_sparse_step", 1)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    fields["moe_expert_hidden_dim"] = hf.get_int("moe_intermediate_size")
    fields.update(num_experts=_num_experts(hf), moe_router="softmax")
    fields["qk_norm"] = "per_head"
    return {**fields, **aux_loss_fields(hf)}


def _num_experts(hf: HFConfig) -> int:
    """The expert count: published folders say num_experts, transformers 5 saves it as
    num_local_experts (its attribute_map's name); either is read, and both must agree."""
    if "num_experts" not in hf.data:
        return hf.get_int("num_local_experts")
    count = hf.get_int("num_experts")
    if hf.data.get("num_local_experts", count) != count:
        raise hf.error("num_local_experts", f"expected num_experts = {count}: one expert count")
    return count


qwen3_moe_tensors_to_hf, qwen3_moe_tensors_from_hf = every_moe_layer_maps(
    BLOCK, EXPERT_NAMES, HF_CLASS
)


QWEN3_MOE = Architecture(
    model_type="qwen3_moe",
    hf_class=HF_CLASS,
    requires=(
        moe_requirement(HF_CLASS),
        router_requirement("softmax", HF_CLASS, "Qwen3-MoE's router takes a softmax"),
        NO_SHARED_EXPERTS,
        PER_HEAD_QK_NORM,
    ),
    config_fields=qwen3_moe_config_fields,
    config_keys=qwen3_moe_config_keys,
    tensors_to_hf=qwen3_moe_tensors_to_hf,
    tensors_from_hf=qwen3_moe_tensors_from_hf,
    own_fields=("head_size", "qk_norm"),
)
