"""Which Hugging Face MoE class computes the same function as our MoE config (Mixtral,
Qwen2-MoE or GLM-4-MoE, see hf_moe.py), and its config.json both ways."""

from __future__ import annotations

from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.hf_config import (
    HFConfig,
    build_model_config,
    check_model_type,
    common_config_json,
    common_model_fields,
)

MIXTRAL = "mixtral"
QWEN2_MOE = "qwen2_moe"
GLM4_MOE = "glm4_moe"
ARCHITECTURES = {
    MIXTRAL: "MixtralForCausalLM",
    QWEN2_MOE: "Qwen2MoeForCausalLM",
    GLM4_MOE: "Glm4MoeForCausalLM",
}
"""model_type -> the causal-LM class a folder of that type names."""


def moe_model_type(cfg: ModelConfig) -> str:
    """The model_type that represents our MoE ``cfg`` exactly, or a ConfigError naming the
    field that no available class can express (see hf_moe.py's docstring)."""
    if cfg.moe_router == "sigmoid":
        if cfg.moe_frequency not in (1, cfg.n_layers):
            raise ConfigError(
                "model.moe_frequency",
                cfg.moe_frequency,
                f"1 or model.n_layers = {cfg.n_layers} for a sigmoid-router export",
                "GLM-4-MoE, the Hugging Face class with this router, has its dense layers "
                "first and MoE layers after them (first_k_dense_replace)",
            )
        if cfg.num_experts < 2:
            raise ConfigError(
                "model.num_experts",
                cfg.num_experts,
                ">= 2 for a sigmoid-router export",
                "GLM-4-MoE's router ranks experts by their two best scores per group",
            )
        return GLM4_MOE
    if cfg.moe_shared_experts:
        raise ConfigError(
            "model.moe_shared_experts",
            cfg.moe_shared_experts,
            "0 for a softmax-router export",
            "Mixtral has no shared experts and Qwen2-MoE scales its shared expert by a "
            "learned sigmoid gate; no Hugging Face class with standard attention adds "
            "ungated shared experts to a softmax router",
        )
    if cfg.moe_top_k >= 2 and cfg.moe_frequency == 1:
        return MIXTRAL
    return QWEN2_MOE


# --- config.json --------------------------------------------------------------------------


def moe_config_json(cfg: ModelConfig, model_type: str, ids: dict[str, int]) -> dict[str, Any]:
    """config.json of the ``model_type`` model equal to our MoE ``cfg``."""
    common = common_config_json(cfg, ids)
    head = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type}
    k, experts = cfg.moe_top_k, cfg.num_experts
    if model_type == MIXTRAL:
        return {
            **head,
            **common,
            "intermediate_size": cfg.expert_hidden_dim,
            "num_local_experts": experts,
            "num_experts_per_tok": k,
            "router_aux_loss_coef": cfg.moe_aux_loss_weight,
            "router_jitter_noise": 0.0,
            "output_router_logits": False,
            "sliding_window": None,
        }
    if model_type == QWEN2_MOE:
        return {
            **head,
            **common,
            "intermediate_size": cfg.hidden_dim,
            "moe_intermediate_size": cfg.expert_hidden_dim,
            "num_experts": experts,
            "num_experts_per_tok": k,
            "norm_topk_prob": k > 1,
            "decoder_sparse_step": cfg.moe_frequency,
            "mlp_only_layers": [],
            "shared_expert_intermediate_size": 0,
            "qkv_bias": True,
            "use_sliding_window": False,
            "router_aux_loss_coef": cfg.moe_aux_loss_weight,
            "output_router_logits": False,
        }
    rope = {**common["rope_parameters"], "partial_rotary_factor": 1.0}
    return {
        **head,
        **common,
        "rope_parameters": rope,
        "partial_rotary_factor": 1.0,
        "intermediate_size": cfg.hidden_dim,
        "moe_intermediate_size": cfg.expert_hidden_dim,
        "n_routed_experts": experts,
        "num_experts_per_tok": k,
        "n_shared_experts": cfg.moe_shared_experts,
        "first_k_dense_replace": 0 if cfg.moe_frequency == 1 else cfg.n_layers - 1,
        "norm_topk_prob": k > 1,
        "routed_scaling_factor": 1.0,
        "n_group": 1,
        "topk_group": 1,
        "use_qk_norm": False,
        "attention_bias": False,
        "num_nextn_predict_layers": 0,
        "output_router_logits": False,
    }


def _top_k_rule(hf: HFConfig, k: int, model_type: str) -> None:
    """Ours renormalises the gates over the k chosen when k > 1 and keeps the raw value for
    k = 1; the folder must do the same."""
    if model_type == MIXTRAL:
        if k < 2:
            raise hf.error(
                "num_experts_per_tok",
                "expected >= 2: Mixtral renormalises a single expert's gate to 1, while "
                "kempnerforge's top-1 router keeps the probability",
            )
        return
    hf.require(
        "norm_topk_prob",
        k > 1,
        None,
        f"kempnerforge renormalises the gates exactly when top-k > 1 (here {k})",
    )


def _moe_frequency(hf: HFConfig, model_type: str, n_layers: int) -> int:
    """Our moe_frequency from the folder's placement of MoE layers."""
    if model_type == MIXTRAL:
        return 1
    if model_type == QWEN2_MOE:
        if hf.data.get("mlp_only_layers"):
            raise hf.error(
                "mlp_only_layers",
                "expected []: kempnerforge places MoE layers by moe_frequency alone",
            )
        return hf.get_int("decoder_sparse_step", 1)
    first_dense = hf.get_int("first_k_dense_replace")
    if first_dense == 0:
        return 1
    if first_dense == n_layers - 1:
        return n_layers
    raise hf.error(
        "first_k_dense_replace",
        f"expected 0 or num_hidden_layers - 1 = {n_layers - 1}: kempnerforge makes every "
        "moe_frequency-th layer MoE, which cannot express other splits",
    )


def moe_model_config(hf: HFConfig, model_type: str) -> ModelConfig:
    """The ModelConfig of an MoE folder of ``model_type``; refuses what we cannot build."""
    check_model_type(hf, model_type, ARCHITECTURES[model_type])
    partial = 0.5 if model_type == GLM4_MOE else 1.0  # GLM-4-MoE's default rotates half
    fields = common_model_fields(hf, llama_defaults=False, partial_default=partial)
    k = hf.get_int("num_experts_per_tok")
    _top_k_rule(hf, k, model_type)
    fields["moe_top_k"] = k
    fields["moe_frequency"] = _moe_frequency(hf, model_type, fields["n_layers"])
    if model_type == MIXTRAL:
        window = hf.data.get("sliding_window")
        if window is not None and window < fields["max_seq_len"]:
            raise hf.error("sliding_window", "expected null: kempnerforge attends to all positions")
        width = hf.get_int("intermediate_size")
        fields.update(num_experts=hf.get_int("num_local_experts"), ffn_hidden_dim=width)
        fields.update(moe_expert_hidden_dim=width, moe_router="softmax")
    else:
        fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
        fields["moe_expert_hidden_dim"] = hf.get_int("moe_intermediate_size")
    if model_type == QWEN2_MOE:
        hf.require("use_sliding_window", False, False, "kempnerforge attends to all positions")
        hf.require(
            "shared_expert_intermediate_size",
            0,
            5632,
            "Qwen2-MoE's shared expert is scaled by a learned sigmoid gate, which "
            "kempnerforge's shared experts do not have",
        )
        fields.update(num_experts=hf.get_int("num_experts"), moe_router="softmax")
    if model_type == GLM4_MOE:
        bias_why = "kempnerforge's projections have no biases"
        hf.require("attention_bias", False, False, bias_why)
        hf.require("use_qk_norm", False, False, "kempnerforge has no query/key norm")
        hf.require("routed_scaling_factor", 1.0, 1.0, "kempnerforge does not scale the gates")
        if hf.get_int("n_group", 1) != hf.get_int("topk_group", 1):
            raise hf.error(
                "topk_group",
                "expected n_group: kempnerforge's router chooses among all experts",
            )
        fields.update(num_experts=hf.get_int("n_routed_experts"), moe_router="sigmoid")
        fields["moe_shared_experts"] = hf.get_int("n_shared_experts")
    coef = hf.data.get("router_aux_loss_coef")
    if isinstance(coef, int | float) and not isinstance(coef, bool) and 0 <= coef <= 1000:
        fields["moe_aux_loss_weight"] = float(coef)
    return build_model_config(fields, hf)
