"""Qwen2-MoE (``Qwen2MoeForCausalLM``): our softmax-router MoE without shared experts, for
what Mixtral cannot write (top-1, or MoE every moe_frequency-th layer).

norm_topk_prob = (k > 1), so a top-1 gate keeps its raw probability as ours does, and
decoder_sparse_step = moe_frequency, the same rule (block i is MoE when (i + 1) % N == 0).
Its shared expert is written with zero width, so it adds exactly nothing; its q/k/v biases
are written as zeros (qkv_bias = true), which also loads exactly in releases that always
had them, and a folder's biases are accepted only when all zero.
"""

from __future__ import annotations

from typing import Any

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import Architecture, Shapes, State
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields
from kempnerforge.interop.architectures.moe_parts import (
    NO_SHARED_EXPERTS,
    aux_loss_fields,
    empty_swiglu,
    experts_from_hf,
    experts_to_hf,
    moe_layers,
    moe_prefixes,
    moe_requirement,
    renormalised_top_k,
    router_requirement,
)
from kempnerforge.interop.architectures.tensor_names import HFTensors, swiglu_pairs
from kempnerforge.interop.hf_files import HFFolderError

HF_CLASS = "Qwen2MoeForCausalLM"
BLOCK = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
"""Its names of an expert's gate, up and down projections (our w1, w3, w2)."""


def qwen2_moe_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the Qwen2-MoE equal to our MoE ``cfg``."""
    return {
        "intermediate_size": cfg.hidden_dim,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "norm_topk_prob": cfg.moe_top_k > 1,
        "decoder_sparse_step": cfg.moe_frequency,
        "mlp_only_layers": [],
        "shared_expert_intermediate_size": 0,
        "qkv_bias": True,
        "use_sliding_window": False,
        "router_aux_loss_coef": cfg.moe_aux_loss_weight,
        "output_router_logits": False,
    }


def qwen2_moe_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a Qwen2-MoE config.json; refuses what we cannot build."""
    fields = common_model_fields(hf, llama_defaults=False)
    fields["moe_top_k"] = renormalised_top_k(hf)
    if hf.data.get("mlp_only_layers"):
        raise hf.error(
            "mlp_only_layers", "expected []: kempnerforge places MoE layers by moe_frequency alone"
        )
    fields["moe_frequency"] = hf.get_int("decoder_sparse_step", 1)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    fields["moe_expert_hidden_dim"] = hf.get_int("moe_intermediate_size")
    hf.require("use_sliding_window", False, False, "kempnerforge attends to all positions")
    hf.require(
        "shared_expert_intermediate_size",
        0,
        5632,
        "Qwen2-MoE's shared expert is scaled by a learned sigmoid gate, which "
        "kempnerforge's shared experts do not have",
    )
    fields.update(num_experts=hf.get_int("num_experts"), moe_router="softmax")
    return {**fields, **aux_loss_fields(hf)}


def _qkv_bias_widths(cfg: ModelConfig) -> tuple[tuple[str, int], ...]:
    kv_width = cfg.kv_heads * cfg.head_dim
    return (("q", cfg.n_heads * cfg.head_dim), ("k", kv_width), ("v", kv_width))


def qwen2_moe_tensors_to_hf(state: State, cfg: ModelConfig) -> State:
    """Router and experts of each MoE layer, its zero-width shared expert and zero gate,
    and every layer's q/k/v biases as zeros."""
    out: State = {}
    for index in moe_layers(cfg):
        out.update(experts_to_hf(state, cfg, index, BLOCK, EXPERT_NAMES))
        ours, hf = moe_prefixes(index, BLOCK)
        for mine, theirs in swiglu_pairs(f"{ours}.shared", f"{hf}.shared_expert"):
            out[theirs] = empty_swiglu(cfg.dim, mine)
        out[f"{hf}.shared_expert_gate.weight"] = torch.zeros(1, cfg.dim)
    for index in range(cfg.n_layers):
        for proj, width in _qkv_bias_widths(cfg):
            out[f"model.layers.{index}.self_attn.{proj}_proj.bias"] = torch.zeros(width)
    return out


def qwen2_moe_tensors_from_hf(
    source: HFTensors, hf: HFConfig, cfg: ModelConfig, shapes: Shapes
) -> State:
    """Our routers and expert stacks from a Qwen2-MoE folder's tensors; its zero-width
    shared experts are passed over, its q/k/v biases must be zero (we have none)."""
    state: State = {}
    for index in moe_layers(cfg):
        state.update(experts_from_hf(source, cfg, index, BLOCK, EXPERT_NAMES, shapes))
        ours, theirs_prefix = moe_prefixes(index, BLOCK)
        for _, theirs in swiglu_pairs(f"{ours}.shared", f"{theirs_prefix}.shared_expert"):
            source.ignore(theirs)  # zero width (checked in config.json): adds nothing
        source.ignore(f"{theirs_prefix}.shared_expert_gate.weight")
    if not hf.get_bool("qkv_bias", True):
        return state
    for index in range(cfg.n_layers):
        for proj, width in _qkv_bias_widths(cfg):
            name = f"model.layers.{index}.self_attn.{proj}_proj.bias"
            if source.take(name, (width,)).any():
                raise HFFolderError(
                    source.folder,
                    f"the tensor {name} is not zero: kempnerforge's attention has no biases",
                )
    return state


QWEN2_MOE = Architecture(
    model_type="qwen2_moe",
    hf_class=HF_CLASS,
    requires=(
        moe_requirement(HF_CLASS),
        router_requirement("softmax", HF_CLASS, "Qwen2-MoE's router takes a softmax"),
        NO_SHARED_EXPERTS,
    ),
    config_fields=qwen2_moe_config_fields,
    config_keys=qwen2_moe_config_keys,
    tensors_to_hf=qwen2_moe_tensors_to_hf,
    tensors_from_hf=qwen2_moe_tensors_from_hf,
)
