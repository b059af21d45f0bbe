"""The MoE layers' tensors under each Hugging Face class's names, both ways: router, experts
(one transposed tensor per expert), router bias, shared experts, Qwen2-MoE's zero biases."""

from __future__ import annotations

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.hf_config import HFConfig
from kempnerforge.interop.hf_files import HFFolderError
from kempnerforge.interop.hf_layout import (
    HFTensors,
    block_pairs,
    dense_ffn_pairs,
    outer_pairs,
    swiglu_pairs,
)
from kempnerforge.interop.hf_moe_config import GLM4_MOE, MIXTRAL, QWEN2_MOE

_BLOCK = {MIXTRAL: "block_sparse_moe", QWEN2_MOE: "mlp", GLM4_MOE: "mlp"}
"""Name of the MoE block inside a layer, as the published checkpoints of each class use."""
_EXPERT_NAMES = {
    MIXTRAL: ("w1", "w3", "w2"),
    QWEN2_MOE: ("gate_proj", "up_proj", "down_proj"),
    GLM4_MOE: ("gate_proj", "up_proj", "down_proj"),
}
"""Each class's names of an expert's gate, up and down projections (our w1, w3, w2)."""


def non_moe_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
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


def moe_tensors_to_hf(
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


def moe_tensors_from_hf(
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


def zero_qkv_biases(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Add Qwen2-MoE's q/k/v biases, all zero, to the tensors being written."""
    kv_width = cfg.kv_heads * cfg.head_dim
    for index in range(cfg.n_layers):
        attn = f"model.layers.{index}.self_attn"
        tensors[f"{attn}.q_proj.bias"] = torch.zeros(cfg.n_heads * cfg.head_dim)
        tensors[f"{attn}.k_proj.bias"] = torch.zeros(kv_width)
        tensors[f"{attn}.v_proj.bias"] = torch.zeros(kv_width)


def check_zero_qkv_biases(source: HFTensors, hf: HFConfig, cfg: ModelConfig) -> None:
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
