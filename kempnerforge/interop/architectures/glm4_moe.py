"""GLM-4-MoE (``Glm4MoeForCausalLM``): our sigmoid-router MoE.

Sigmoid scores, the top k chosen on score + e_score_correction_bias (our expert_bias,
written in fp32) within the topk_group best of n_group expert groups
(model.moe_top_groups, model.moe_num_groups) with the gates from the scores alone,
renormalised when k > 1 (norm_topk_prob) and times routed_scaling_factor
(model.moe_routed_scaling), shared experts summed ungated (written with zero width when
there are none), plain RoPE (partial_rotary_factor 1), no qk-norm: DeepSeek-V3's routing
over standard attention. Its dense layers come first (first_k_dense_replace:
model.moe_first_dense_layers with moe_frequency 1, or moe_frequency = n_layers for the
last layer alone). Its multi-token-prediction layers, after the decoder's, do not change
the next-token function and are not imported.
"""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.architectures.architecture import (
    Architecture,
    Requirement,
    Shapes,
    State,
)
from kempnerforge.interop.architectures.config_keys import HFConfig, common_model_fields
from kempnerforge.interop.architectures.moe_parts import (
    DEEPSEEK_ROUTER_FIELDS,
    aux_loss_fields,
    dense_first_fields,
    dense_first_requirement,
    empty_swiglu,
    experts_from_hf,
    experts_to_hf,
    group_routing_fields,
    group_routing_keys,
    moe_layers,
    moe_prefixes,
    moe_requirement,
    renormalised_top_k,
    router_requirement,
)
from kempnerforge.interop.architectures.mtp_layers import mtp_depth_field
from kempnerforge.interop.architectures.tensor_names import HFTensors, swiglu_pairs

HF_CLASS = "Glm4MoeForCausalLM"
BLOCK = "mlp"
EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
"""Its names of an expert's gate, up and down projections (our w1, w3, w2)."""


def glm4_moe_config_keys(cfg: ModelConfig) -> dict[str, Any]:
    """config.json keys of the GLM-4-MoE equal to our MoE ``cfg`` (its defaults for the
    rotary fraction and the qk-norm differ from ours, so both are written)."""
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": 1.0}
    return {
        "rope_parameters": rope,
        "partial_rotary_factor": 1.0,
        "intermediate_size": cfg.hidden_dim,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.moe_top_k,
        "n_shared_experts": cfg.moe_shared_experts,
        "norm_topk_prob": cfg.moe_top_k > 1,
        **group_routing_keys(cfg),
        "use_qk_norm": False,
        "attention_bias": False,
        "num_nextn_predict_layers": cfg.mtp_depth,
        "output_router_logits": False,
    }


def glm4_moe_config_fields(hf: HFConfig) -> dict[str, Any]:
    """ModelConfig fields of a GLM-4-MoE config.json; refuses what we cannot build."""
    # GLM-4-MoE's own default rotates half of each head: an absent factor is refused.
    fields = common_model_fields(hf, llama_defaults=False, partial_default=0.5)
    fields["moe_top_k"] = renormalised_top_k(hf)
    fields.update(dense_first_fields(hf, fields["n_layers"]))
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    fields["moe_expert_hidden_dim"] = hf.get_int("moe_intermediate_size")
    hf.require("attention_bias", False, False, "kempnerforge's projections have no biases")
    hf.require("use_qk_norm", False, False, "kempnerforge has no query/key norm")
    fields.update(group_routing_fields(hf))
    fields.update(num_experts=hf.get_int("n_routed_experts"), moe_router="sigmoid")
    fields["moe_shared_experts"] = hf.get_int("n_shared_experts")
    fields["mtp_depth"] = mtp_depth_field(hf)
    return {**fields, **aux_loss_fields(hf)}


def glm4_moe_tensors_to_hf(state: State, cfg: ModelConfig) -> State:
    """Router, router bias, experts and shared experts (zero width when there are none) of
    each MoE layer."""
    out: State = {}
    for index in moe_layers(cfg):
        out.update(experts_to_hf(state, cfg, index, BLOCK, EXPERT_NAMES))
        ours, hf = moe_prefixes(index, BLOCK)
        out[f"{hf}.gate.e_score_correction_bias"] = state[f"{ours}.router.expert_bias"]
        for mine, theirs in swiglu_pairs(f"{ours}.shared", f"{hf}.shared_experts"):
            out[theirs] = state.get(mine, empty_swiglu(cfg.dim, mine))
    return out


def glm4_moe_tensors_from_hf(
    source: HFTensors, hf: HFConfig, cfg: ModelConfig, shapes: Shapes
) -> State:
    """Our routers, router biases, expert stacks and shared experts from a GLM-4-MoE
    folder's tensors; its multi-token-prediction layers are passed over."""
    state: State = {}
    for index in moe_layers(cfg):
        state.update(experts_from_hf(source, cfg, index, BLOCK, EXPERT_NAMES, shapes))
        ours, theirs_prefix = moe_prefixes(index, BLOCK)
        state[f"{ours}.router.expert_bias"] = source.take(
            f"{theirs_prefix}.gate.e_score_correction_bias", (cfg.num_experts,)
        )
        for mine, theirs in swiglu_pairs(f"{ours}.shared", f"{theirs_prefix}.shared_experts"):
            if cfg.moe_shared_experts:
                state[mine] = source.take(theirs, shapes[mine])
            else:
                source.take(theirs, empty_swiglu(cfg.dim, mine).shape)
    extra = hf.get_int("num_nextn_predict_layers", 1)
    source.ignore_prefixes(tuple(f"model.layers.{cfg.n_layers + i}." for i in range(extra)))
    return state


GLM4_MOE = Architecture(
    model_type="glm4_moe",
    hf_class=HF_CLASS,
    requires=(
        moe_requirement(HF_CLASS),
        router_requirement("sigmoid", HF_CLASS, "GLM-4-MoE's router scores with a sigmoid"),
        dense_first_requirement("GLM-4-MoE"),
        Requirement(
            "num_experts",
            lambda cfg: cfg.num_experts >= 2,
            ">= 2 for a sigmoid-router export",
            "GLM-4-MoE's router ranks experts by their two best scores per group",
        ),
    ),
    config_fields=glm4_moe_config_fields,
    config_keys=glm4_moe_config_keys,
    tensors_to_hf=glm4_moe_tensors_to_hf,
    tensors_from_hf=glm4_moe_tensors_from_hf,
    own_fields=(*DEEPSEEK_ROUTER_FIELDS, "mtp_depth"),
)
