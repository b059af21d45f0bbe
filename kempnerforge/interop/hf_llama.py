"""Our dense Transformer <-> a Hugging Face ``LlamaForCausalLM`` folder.

A dense model of ours is a Llama (see hf_layout for why every tensor maps one to one), so
the export copies tensors under Llama's names, writes config.json and, when the job's
tokenizer is a Hugging Face one, its files; the import reverses it bit for bit. MoE models
go through hf_moe (export_hf in hf.py picks the right one).
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
    copy_tokenizer,
    read_hf_config,
    read_safetensors,
    special_token_ids,
    write_generation_config,
    write_hf_folder,
)
from kempnerforge.interop.hf_layout import (
    HFTensors,
    block_pairs,
    dense_ffn_pairs,
    expected_shapes,
    outer_pairs,
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

LLAMA_ARCHITECTURE = "LlamaForCausalLM"
LLAMA_MODEL_TYPE = "llama"


def llama_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(our name, Hugging Face name) of every tensor of a dense model."""
    pairs = outer_pairs(cfg.tie_embeddings)
    for index in range(cfg.n_layers):
        pairs += block_pairs(index) + dense_ffn_pairs(index)
    return pairs


def llama_config_json(cfg: ModelConfig, special_ids: dict[str, int]) -> dict[str, Any]:
    """config.json of the LlamaForCausalLM equal to our dense model ``cfg``."""
    return {
        "architectures": [LLAMA_ARCHITECTURE],
        "model_type": LLAMA_MODEL_TYPE,
        **common_config_json(cfg, special_ids),
        "intermediate_size": cfg.hidden_dim,
        "attention_bias": False,
        "mlp_bias": False,
        "pretraining_tp": 1,
    }


def check_dense(cfg: ModelConfig) -> None:
    """Refuse an MoE config: a Llama has one dense feed-forward per layer."""
    if cfg.is_moe:
        raise ConfigError(
            "model.num_experts",
            cfg.num_experts,
            "0 for a LlamaForCausalLM export",
            "an MoE model is written as Mixtral, Qwen2-MoE or GLM-4-MoE by export_hf",
        )


def export_llama(
    model: nn.Module,
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike[str],
    tokenizer_path: str | None = None,
) -> Path:
    """Write ``model`` (our dense Transformer) as a LlamaForCausalLM folder; return it.

    ``tokenizer_path`` is data.tokenizer: 'byte' puts the byte tokenizer's bos/eos/pad ids
    in config.json and writes no tokenizer; a tokenizer.json (or its directory) is copied.
    Weights are written in fp32. Raises ConfigError for a model Llama cannot represent.
    """
    transformer = check_text_model(model)
    check_known_fields(model_cfg)
    check_built_from(transformer, model_cfg)
    check_dense(model_cfg)
    state = plain_state(transformer)
    tensors = {hf: state[ours] for ours, hf in llama_pairs(model_cfg)}
    ids = special_token_ids(tokenizer_path)
    folder = write_hf_folder(out_dir, llama_config_json(model_cfg, ids), tensors)
    copy_tokenizer(tokenizer_path, folder)
    write_generation_config(tokenizer_path, folder)
    return folder


def llama_model_config(hf: HFConfig) -> ModelConfig:
    """The ModelConfig of a LlamaForCausalLM config.json; refuses what we cannot build."""
    check_model_type(hf, LLAMA_MODEL_TYPE, LLAMA_ARCHITECTURE)
    why = "kempnerforge's projections have no biases"
    hf.require("attention_bias", False, False, why)
    hf.require("mlp_bias", False, False, why)
    fields = common_model_fields(hf, llama_defaults=True)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    return build_model_config(fields, hf)


def import_llama(hf_dir: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our state dict) of a LlamaForCausalLM folder, tensors in fp32.

    Reads config.json and safetensors only. Raises HFFolderError naming the key or the
    tensor for another architecture, a feature we lack, a missing, mis-shaped or extra
    tensor.
    """
    hf = HFConfig(read_hf_config(hf_dir), hf_dir)
    cfg = llama_model_config(hf)
    source = HFTensors(read_safetensors(hf_dir), hf_dir)
    state: dict[str, torch.Tensor] = {}
    take_pairs(source, llama_pairs(cfg), expected_shapes(cfg), state)
    tie_head(cfg, state, source)
    source.check_all_used()
    return cfg, state


def load_llama_into(model: nn.Module, hf_dir: str | os.PathLike[str]) -> ModelConfig:
    """Load a LlamaForCausalLM folder's weights into our freshly built ``model``.

    The folder's model must be the one model.cfg describes: a differing field is a
    ConfigError naming it and the folder's value. Returns the folder's ModelConfig.
    """
    transformer = check_text_model(model, whole=False)
    found, state = import_llama(hf_dir)
    check_same_model(transformer.cfg, found, hf_dir)
    copy_into(transformer, state, str(hf_dir))
    return found
