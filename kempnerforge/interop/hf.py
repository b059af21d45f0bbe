"""One entry point per direction, whatever the model: each asks the registered architectures
(interop/architectures/), export for the first that represents the model exactly, import for
the one the folder's model_type names. The command line and the training build call these,
not the architectures."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kempnerforge.config.loader import build_dataclass
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import (
    ARCHITECTURES,
    Architecture,
    HFConfig,
    HFTensors,
    held_mtp_depth,
)
from kempnerforge.interop.hf_files import (
    copy_tokenizer,
    read_hf_config,
    read_safetensors,
    special_token_ids,
    write_generation_config,
    write_hf_folder,
)
from kempnerforge.interop.hf_model_checks import (
    check_built_from,
    check_known_fields,
    check_same_model,
    check_text_model,
    differing_field,
)
from kempnerforge.interop.hf_state import copy_into, plain_state
from kempnerforge.interop.mxfp4 import dequantize_folder_tensors, is_mxfp4

SUPPORTED_MODEL_TYPES = ARCHITECTURES.model_types
"""The model_types import and export know, in registration order (a live view)."""


def hf_architecture(model_cfg: ModelConfig) -> str:
    """The Hugging Face class ``model_cfg`` is exported as; a ConfigError names the field
    no available class can represent. Cheap: call it before loading any weights."""
    check_known_fields(model_cfg)
    return ARCHITECTURES.for_config(model_cfg).hf_class


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
    model_type: str | None = None,
) -> Path:
    """Write ``model`` as a Hugging Face folder (config.json, model.safetensors in fp32,
    tokenizer files when data.tokenizer is a Hugging Face one); return the folder.

    ``tokenizer_path`` is data.tokenizer: 'byte' puts the byte tokenizer's bos/eos/pad ids
    in config.json and writes no tokenizer; a tokenizer.json (or its directory) is copied.
    The class is the first registered one that represents the model exactly, or the one
    ``model_type`` names; a ConfigError names the field it cannot represent.
    """
    transformer = check_text_model(model)
    check_known_fields(model_cfg)
    check_built_from(transformer, model_cfg)
    architecture = _architecture_for(model_cfg, model_type)
    tensors = architecture.to_hf(plain_state(transformer), model_cfg)
    config = architecture.write_config(model_cfg, special_token_ids(tokenizer_path))
    folder = write_hf_folder(out_dir, config, tensors)
    copy_tokenizer(tokenizer_path, folder)
    write_generation_config(tokenizer_path, folder)
    return folder


def _architecture_for(model_cfg: ModelConfig, model_type: str | None) -> Architecture:
    if model_type is None:
        return ARCHITECTURES.for_config(model_cfg)
    architecture = ARCHITECTURES.named(model_type)
    architecture.check_represents(model_cfg)
    return architecture


def import_hf(
    hf_dir: str | os.PathLike[str], model_type: str | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, our state dict, fp32) of a Hugging Face folder of a registered
    architecture (the one ``model_type`` names, when given); an HFFolderError names the
    key or tensor that does not fit. Reads config.json and safetensors only. Multi-token-
    prediction layers the folder holds are imported (model.mtp_depth; architectures/
    mtp_layers.py says why always)."""
    hf = HFConfig(read_hf_config(hf_dir), hf_dir)
    if model_type is None:
        architecture = ARCHITECTURES.of_folder(hf)
    else:
        architecture = ARCHITECTURES.named(model_type)
    cfg = architecture.read_config(hf)
    tensors = read_safetensors(hf_dir)
    if is_mxfp4(hf.data):  # published GPT-OSS: the experts in MXFP4, read back exactly
        tensors = dequantize_folder_tensors(tensors)
    source = HFTensors(tensors, hf_dir)
    cfg = held_mtp_depth(cfg, source)
    return cfg, architecture.from_hf(source, hf, cfg)


def load_hf_into(
    model: nn.Module, hf_dir: str | os.PathLike[str], model_type: str | None = None
) -> ModelConfig:
    """Load a Hugging Face folder's weights into our freshly built ``model`` (the training
    build's initialisation from a published model); return the folder's ModelConfig. The
    folder's model must be the one model.cfg describes; a differing field is a ConfigError
    naming it and the folder's value."""
    transformer = check_text_model(model, whole=False)
    found, state = import_hf(hf_dir, model_type)
    check_same_model(transformer.cfg, found, hf_dir)
    copy_into(transformer, state, str(hf_dir))
    return found
