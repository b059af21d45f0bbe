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

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.hf_config import HFConfig
from kempnerforge.interop.hf_files import (
    copy_tokenizer,
    read_hf_config,
    read_safetensors,
    special_token_ids,
    write_generation_config,
    write_hf_folder,
)
from kempnerforge.interop.hf_layout import HFTensors, expected_shapes, take_pairs, tie_head
from kempnerforge.interop.hf_model_checks import (
    check_built_from,
    check_known_fields,
    check_same_model,
    check_text_model,
)
from kempnerforge.interop.hf_moe_config import (
    ARCHITECTURES,
    GLM4_MOE,
    QWEN2_MOE,
    moe_config_json,
    moe_model_config,
    moe_model_type,
)
from kempnerforge.interop.hf_moe_tensors import (
    check_zero_qkv_biases,
    moe_tensors_from_hf,
    moe_tensors_to_hf,
    non_moe_pairs,
    zero_qkv_biases,
)
from kempnerforge.interop.hf_state import copy_into, plain_state


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
    tensors = {hf: state[ours] for ours, hf in non_moe_pairs(model_cfg)}
    for index in range(model_cfg.n_layers):
        if model_cfg.is_moe_layer(index):
            tensors.update(moe_tensors_to_hf(state, model_cfg, model_type, index))
    if model_type == QWEN2_MOE:
        zero_qkv_biases(model_cfg, tensors)
    config = moe_config_json(model_cfg, model_type, special_token_ids(tokenizer_path))
    folder = write_hf_folder(out_dir, config, tensors)
    copy_tokenizer(tokenizer_path, folder)
    write_generation_config(tokenizer_path, folder)
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
    take_pairs(source, non_moe_pairs(cfg), shapes, state)
    for index in range(cfg.n_layers):
        if cfg.is_moe_layer(index):
            moe_tensors_from_hf(source, cfg, model_type, index, shapes, state)
    if model_type == QWEN2_MOE:
        check_zero_qkv_biases(source, hf, cfg)
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
