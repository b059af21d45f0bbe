"""One entry point per direction, whatever the model: a dense model is a Llama, an MoE
model the class hf_moe picks for its router. The command line and the training build call
these, not the per-architecture modules."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kempnerforge.config.loader import build_dataclass
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.hf_files import CONFIG_JSON, HFFolderError, read_hf_config
from kempnerforge.interop.hf_llama import (
    LLAMA_ARCHITECTURE,
    LLAMA_MODEL_TYPE,
    export_llama,
    import_llama,
    load_llama_into,
)
from kempnerforge.interop.hf_model_checks import check_known_fields, differing_field
from kempnerforge.interop.hf_moe import export_moe, import_moe, load_moe_into
from kempnerforge.interop.hf_moe_config import ARCHITECTURES, moe_model_type

SUPPORTED_MODEL_TYPES = (LLAMA_MODEL_TYPE, *ARCHITECTURES)


def hf_architecture(model_cfg: ModelConfig) -> str:
    """The Hugging Face class ``model_cfg`` is exported as; a ConfigError names the field
    no available class can represent. Cheap: call it before loading any weights."""
    check_known_fields(model_cfg)
    if not model_cfg.is_moe:
        return LLAMA_ARCHITECTURE
    return ARCHITECTURES[moe_model_type(model_cfg)]


def check_exportable(
    model_cfg: ModelConfig, recorded: dict[str, Any] | None, checkpoint: str | os.PathLike[str]
) -> str:
    """The Hugging Face class a checkpoint's model is exported as (hf_architecture), after
    refusing a config whose model computes another function than the one the checkpoint
    was trained as (``recorded``: the config it recorded; a stale config.toml, a wrong
    override), naming the field. Cheap: call it before loading any weights."""
    check_recorded_model(model_cfg, recorded, checkpoint)
    return hf_architecture(model_cfg)


def check_recorded_model(
    model_cfg: ModelConfig, recorded: dict[str, Any] | None, checkpoint: str | os.PathLike[str]
) -> None:
    """Refuse ``model_cfg`` where a field that decides the weights' meaning differs from
    the [model] the checkpoint recorded; nothing to compare when it recorded none."""
    saved = recorded.get("model") if recorded is not None else None
    if not isinstance(saved, dict):
        return
    try:
        trained = build_dataclass(ModelConfig, saved, prefix="model.")
    except ConfigError:
        return  # recorded by a release with other fields: the weight load still checks shapes
    differs = differing_field(model_cfg, trained)
    if differs is not None:
        field, name = differs
        raise ConfigError(
            field,
            getattr(model_cfg, name),
            f"{getattr(trained, name)!r}, the value {checkpoint} was trained with",
            "the weights compute another model under this value; fix --config or drop the override",
        )


def export_hf(
    model: nn.Module,
    model_cfg: ModelConfig,
    out_dir: str | os.PathLike[str],
    tokenizer_path: str | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face folder (config.json, model.safetensors, tokenizer
    files when data.tokenizer is a Hugging Face one); return the folder."""
    if model_cfg.is_moe:
        return export_moe(model, model_cfg, out_dir, tokenizer_path)
    return export_llama(model, model_cfg, out_dir, tokenizer_path)


def _model_type(hf_dir: str | os.PathLike[str]) -> str:
    model_type = read_hf_config(hf_dir).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise HFFolderError(
            Path(hf_dir) / CONFIG_JSON,
            f"model_type = {model_type!r}: expected one of {', '.join(SUPPORTED_MODEL_TYPES)} "
            "(the architectures kempnerforge computes exactly)",
        )
    return model_type


def import_hf(hf_dir: str | os.PathLike[str]) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our state dict, fp32) of a Llama, Mixtral, Qwen2-MoE or GLM-4-MoE
    folder; an HFFolderError names the key or tensor that does not fit."""
    if _model_type(hf_dir) == LLAMA_MODEL_TYPE:
        return import_llama(hf_dir)
    return import_moe(hf_dir)


def load_hf_into(model: nn.Module, hf_dir: str | os.PathLike[str]) -> ModelConfig:
    """Load a Hugging Face folder's weights into our freshly built ``model`` (the training
    build's initialisation from a published model). The folder's model must be the one
    model.cfg describes; a differing field is a ConfigError naming it."""
    if _model_type(hf_dir) == LLAMA_MODEL_TYPE:
        return load_llama_into(model, hf_dir)
    return load_moe_into(model, hf_dir)
