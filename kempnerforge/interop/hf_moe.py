"""Our MoE Transformer <-> the Hugging Face MoE class that computes the same function.

Attention, norms, embedding and head map as in hf_layout. The feed-forward of an MoE layer
needs a class whose router does exactly what ours does:

- 'softmax', top-k >= 2, every layer MoE, no shared experts: ``MixtralForCausalLM``.
  Mixtral takes softmax over the router logits, the top k, renormalised over the k.
- 'softmax' otherwise (top-1, or moe_frequency > 1), no shared experts:
  ``Qwen2MoeForCausalLM`` with norm_topk_prob = (k > 1), so a top-1 gate keeps its raw
  probability as ours does (Mixtral would renormalise it to 1), and decoder_sparse_step =
  moe_frequency, the same rule (block i is MoE when (i + 1) % N == 0). Its shared expert is
  written with zero width, so it adds exactly nothing; its q/k/v biases are written as zeros
  (qkv_bias = true), which also loads exactly in releases that always had them.
- 'sigmoid': ``Glm4MoeForCausalLM``: sigmoid scores, the top k chosen on score +
  e_score_correction_bias (our expert_bias) with the gates from the scores alone,
  renormalised when k > 1 (norm_topk_prob), routed_scaling_factor 1, one expert group
  (n_group = topk_group = 1: no group restriction), shared experts summed ungated, plain
  RoPE (partial_rotary_factor 1), no qk-norm. Its dense layers come first
  (first_k_dense_replace), so moe_frequency must be 1 or n_layers.

Anything else (softmax with shared experts: Qwen2-MoE gates its shared expert with a
learned sigmoid, DeepSeek-V2/V3 use latent attention) is refused with a ConfigError
naming the field. Expert weights are written one tensor per expert, the layout published
checkpoints use (transformers 5 fuses them on load): ours are (experts, in, out) stacks,
theirs nn.Linear (out, in) matrices, so each expert slice is transposed, which is exact.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.hf_config import (
    HFConfig,
    build_model_config,
    check_model_type,
    common_config_json,
    common_model_fields,
)
from kempnerforge.interop.hf_files import (
    HFFolderError,
    copy_tokenizer,
    read_hf_config,
    read_safetensors,
    special_token_ids,
    write_hf_folder,
)
from kempnerforge.interop.hf_layout import (
    HFTensors,
    block_pairs,
    dense_ffn_pairs,
    expected_shapes,
    outer_pairs,
    swiglu_pairs,
    take_pairs,
    tie_head,
)
from kempnerforge.interop.hf_model_checks import (
    check_built_from,
    check_known_fields,
    check_same_model,
    check_text_model,
)
from kempnerforge.interop.hf_state import copy_into, plain_state

MIXTRAL = "mixtral"
QWEN2_MOE = "qwen2_moe"
GLM4_MOE = "glm4_moe"
ARCHITECTURES = {
    MIXTRAL: "MixtralForCausalLM",
    QWEN2_MOE: "Qwen2MoeForCausalLM",
    GLM4_MOE: "Glm4MoeForCausalLM",
}
"""model_type -> the causal-LM class a folder of that type names."""
_BLOCK = {MIXTRAL: "block_sparse_moe", QWEN2_MOE: "mlp", GLM4_MOE: "mlp"}
"""Name of the MoE block inside a layer, as the published checkpoints of each class use."""
_EXPERT_NAMES = {
    MIXTRAL: ("w1", "w3", "w2"),
    QWEN2_MOE: ("gate_proj", "up_proj", "down_proj"),
    GLM4_MOE: ("gate_proj", "up_proj", "down_proj"),
}
"""Each class's names of an expert's gate, up and down projections (our w1, w3, w2)."""


# --- Which class ----------------------------------------------------------------------------


def moe_model_type(cfg: ModelConfig) -> str:
    """The model_type that represents our MoE ``cfg`` exactly, or a ConfigError naming the
    field that no available class can express (see the module docstring)."""
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


# --- Tensors ------------------------------------------------------------------------------


def _non_moe_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, HF name) of every one-to-one tensor: all but the MoE blocks' routers,
    experts and shared experts."""
    pairs = outer_pairs(cfg.tie_embeddings)
    for index in range(cfg.n_layers):
        pairs += block_pairs(index)
        if not cfg.is_moe_layer(index):
            pairs += dense_ffn_pairs(index)
    return pairs


def _names(model_type: str, index: int) -> tuple[str, str]:
    return f"layers.{index}.feed_forward", f"model.layers.{index}.{_BLOCK[model_type]}"


def _moe_tensors_to_hf(
    state: dict[str, torch.Tensor], cfg: ModelConfig, model_type: str, index: int
) -> dict[str, torch.Tensor]:
    """HF tensors of MoE layer ``index``: router, experts (transposed), bias, shared."""
    ours, hf = _names(model_type, index)
    out = {f"{hf}.gate.weight": state[f"{ours}.router.gate.weight"]}
    for mine, theirs in zip(("w1", "w3", "w2"), _EXPERT_NAMES[model_type], strict=True):
        stacked = state[f"{ours}.experts.{mine}"]
        for expert in range(cfg.num_experts):
            out[f"{hf}.experts.{expert}.{theirs}.weight"] = stacked[expert].T
    if model_type == GLM4_MOE:
        out[f"{hf}.gate.e_score_correction_bias"] = state[f"{ours}.router.expert_bias"]
        for mine, theirs in swiglu_pairs(f"{ours}.shared", f"{hf}.shared_experts"):
            out[theirs] = state.get(mine, _empty_swiglu(cfg.dim, mine))
    if model_type == QWEN2_MOE:
        for mine, theirs in swiglu_pairs(f"{ours}.shared", f"{hf}.shared_expert"):
            out[theirs] = _empty_swiglu(cfg.dim, mine)
        out[f"{hf}.shared_expert_gate.weight"] = torch.zeros(1, cfg.dim)
    return out


def _empty_swiglu(dim: int, name: str) -> torch.Tensor:
    """A zero-width SwiGLU projection: (0, dim) for w1 / w3, (dim, 0) for w2."""
    return torch.zeros(dim, 0) if ".w2." in name else torch.zeros(0, dim)


def _moe_tensors_from_hf(
    source: HFTensors,
    cfg: ModelConfig,
    model_type: str,
    index: int,
    shapes: dict[str, torch.Size],
    into: dict[str, torch.Tensor],
) -> None:
    """Our tensors of MoE layer ``index`` from the folder's, shapes checked by name."""
    ours, hf = _names(model_type, index)
    into[f"{ours}.router.gate.weight"] = source.take(
        f"{hf}.gate.weight", shapes[f"{ours}.router.gate.weight"]
    )
    for mine, theirs in zip(("w1", "w3", "w2"), _EXPERT_NAMES[model_type], strict=True):
        stacked = shapes[f"{ours}.experts.{mine}"]
        per_expert = (stacked[2], stacked[1])
        slices = [
            source.take(f"{hf}.experts.{e}.{theirs}.weight", per_expert).T
            for e in range(cfg.num_experts)
        ]
        into[f"{ours}.experts.{mine}"] = torch.stack(slices).contiguous()
    if model_type == GLM4_MOE:
        into[f"{ours}.router.expert_bias"] = source.take(
            f"{hf}.gate.e_score_correction_bias", (cfg.num_experts,)
        )
        for mine, theirs in swiglu_pairs(f"{ours}.shared", f"{hf}.shared_experts"):
            if cfg.moe_shared_experts:
                into[mine] = source.take(theirs, shapes[mine])
            else:
                source.take(theirs, _empty_swiglu(cfg.dim, mine).shape)
    if model_type == QWEN2_MOE:
        for _, theirs in swiglu_pairs(f"{ours}.shared", f"{hf}.shared_expert"):
            source.ignore(theirs)  # zero width (checked in config.json): adds nothing
        source.ignore(f"{hf}.shared_expert_gate.weight")


def _zero_qkv_biases(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Add Qwen2-MoE's q/k/v biases, all zero, to the tensors being written."""
    kv_width = cfg.kv_heads * cfg.head_dim
    for index in range(cfg.n_layers):
        attn = f"model.layers.{index}.self_attn"
        tensors[f"{attn}.q_proj.bias"] = torch.zeros(cfg.n_heads * cfg.head_dim)
        tensors[f"{attn}.k_proj.bias"] = torch.zeros(kv_width)
        tensors[f"{attn}.v_proj.bias"] = torch.zeros(kv_width)


def _check_zero_qkv_biases(source: HFTensors, hf: HFConfig, cfg: ModelConfig) -> None:
    """Qwen2-MoE with qkv_bias: every bias must be zero, as kempnerforge has none."""
    if not hf.get_bool("qkv_bias", True):
        return
    kv_width = cfg.kv_heads * cfg.head_dim
    for index in range(cfg.n_layers):
        attn = f"model.layers.{index}.self_attn"
        for proj, width in (("q", cfg.n_heads * cfg.head_dim), ("k", kv_width), ("v", kv_width)):
            name = f"{attn}.{proj}_proj.bias"
            if source.take(name, (width,)).any():
                raise HFFolderError(
                    source.folder,
                    f"the tensor {name} is not zero: kempnerforge's attention has no biases",
                )


# --- Export and import --------------------------------------------------------------------


def export_moe(
    model: nn.Module,
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike[str],
    tokenizer_path: str | None = None,
) -> Path:
    """Write our MoE ``model`` as the Hugging Face MoE class that matches it; return the
    folder. A ConfigError names the field no available class can represent."""
    transformer = check_text_model(model)
    check_known_fields(model_cfg)
    check_built_from(transformer, model_cfg)
    if not model_cfg.is_moe:
        raise ConfigError("model.num_experts", 0, "> 0 for an MoE export", "use export_llama")
    model_type = moe_model_type(model_cfg)
    state = plain_state(transformer)
    tensors = {hf: state[ours] for ours, hf in _non_moe_pairs(model_cfg)}
    for index in range(model_cfg.n_layers):
        if model_cfg.is_moe_layer(index):
            tensors.update(_moe_tensors_to_hf(state, model_cfg, model_type, index))
    if model_type == QWEN2_MOE:
        _zero_qkv_biases(model_cfg, tensors)
    config = moe_config_json(model_cfg, model_type, special_token_ids(tokenizer_path))
    folder = write_hf_folder(out_dir, config, tensors)
    copy_tokenizer(tokenizer_path, folder)
    return folder


def import_moe(hf_dir: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our state dict) of a Mixtral, Qwen2-MoE or GLM-4-MoE folder (fp32).

    Raises HFFolderError naming the config key or tensor that does not fit.
    """
    hf = HFConfig(read_hf_config(hf_dir), hf_dir)
    model_type = hf.data.get("model_type")
    if model_type not in ARCHITECTURES:
        raise hf.error("model_type", f"expected one of {sorted(ARCHITECTURES)}")
    cfg = moe_model_config(hf, model_type)
    source = HFTensors(read_safetensors(hf_dir), hf_dir)
    shapes = expected_shapes(cfg)
    state: dict[str, torch.Tensor] = {}
    take_pairs(source, _non_moe_pairs(cfg), shapes, state)
    for index in range(cfg.n_layers):
        if cfg.is_moe_layer(index):
            _moe_tensors_from_hf(source, cfg, model_type, index, shapes, state)
    if model_type == QWEN2_MOE:
        _check_zero_qkv_biases(source, hf, cfg)
    tie_head(cfg, state, source)
    # GLM-4-MoE's multi-token-prediction layers sit after the decoder's; they do not change
    # the model's next-token function, and are left out.
    extra = hf.get_int("num_nextn_predict_layers", 1) if model_type == GLM4_MOE else 0
    after = tuple(f"model.layers.{cfg.n_layers + i}." for i in range(extra))
    source.check_all_used(ignore_prefixes=after)
    return cfg, state


def load_moe_into(model: nn.Module, hf_dir: str | os.PathLike[str]) -> ModelConfig:
    """Load an MoE folder's weights (router biases included) into our built ``model``."""
    transformer = check_text_model(model, whole=False)
    found, state = import_moe(hf_dir)
    check_same_model(transformer.cfg, found, hf_dir)
    copy_into(transformer, state, str(hf_dir))
    return found
