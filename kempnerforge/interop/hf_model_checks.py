"""Which ModelConfig fields a Hugging Face model carries, and the checks that a model, the
config it is exported with and a folder it is loaded from describe the same function."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from typing import Any

from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model.transformer import Transformer

ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_size",
    "qk_norm",
    "norm_placement",
    "vocab_size",
    "max_seq_len",
    "rope_theta",
    "norm_eps",
    "ffn_hidden_dim",
    "ffn_multiplier",
    "multiple_of",
    "tie_embeddings",
    "num_experts",
    "moe_top_k",
    "moe_frequency",
    "moe_router",
    "moe_shared_experts",
    "moe_expert_hidden_dim",
    "sliding_window",
    "sliding_window_pattern",
    "layer_types",
    "zero_centered_norms",
    "ffn_activation",
    "attention_scale_size",
    "embedding_multiplier",
    "rope_local_theta",
    "attention_sinks",
    "attention_bias",
    "moe_router_bias",
    "moe_expert_bias",
    "moe_activation",
    "moe_swiglu_limit",
    "moe_swiglu_alpha",
    "rope_scaling",
    "rope_scaling_factor",
    "rope_original_max_seq_len",
    "rope_yarn_beta_fast",
    "rope_yarn_beta_slow",
    "rope_yarn_truncate",
    "rope_yarn_mscale",
    "rope_yarn_mscale_all_dim",
    "mla_kv_rank",
    "mla_q_rank",
    "mla_nope_head_size",
    "mla_rope_head_size",
    "mla_value_head_size",
    "moe_num_groups",
    "moe_top_groups",
    "moe_routed_scaling",
    "moe_first_dense_layers",
    "mtp_depth",
)
"""ModelConfig fields that shape the weights or the function they compute."""
TRAINING_FIELDS = (
    "init_std",
    "moe_capacity_factor",
    "moe_aux_loss_weight",
    "moe_aux_loss_level",
    "moe_router_z_loss_weight",
    "moe_bias_update_rate",
    "moe_bias_schedule",
    "mtp_loss_weight",
)
"""ModelConfig fields that only change how the weights are trained; the exported model is
dropless (as our own generation is), whatever moe_capacity_factor says."""


def check_text_model(model: nn.Module, *, whole: bool = True) -> Transformer:
    """``model`` as a decoder-only Transformer (``whole``: with every layer, embedding and
    head, not a pipeline stage), or a ConfigError saying why not."""
    if not isinstance(model, Transformer):
        raise ConfigError(
            "vlm",
            type(model).__name__,
            "a text-only job (no [vlm] table): a decoder-only Transformer",
            "the Hugging Face export writes causal language models; a vision-language "
            "model's encoder, adapter and cross-attention blocks have no place in them",
        )
    if not whole:
        return model
    missing = model.tok_embeddings is None or model.norm is None or model.output is None
    if missing or len(model.layers) != model.cfg.n_layers:
        raise ConfigError(
            "distributed.pp",
            "a pipeline stage",
            "the whole model in one process",
            "export a model built with build_model(config.model), not one pipeline stage",
        )
    return model


def first_unknown_field(cfg: ModelConfig, known: Collection[str]) -> tuple[str, Any, Any] | None:
    """(name, value, default) of the first ModelConfig field not in ``known`` that is set
    away from its default; None when there is none."""
    for field in dataclasses.fields(cfg):
        if field.name in known or not field.init:
            continue
        default = (
            field.default_factory()
            if field.default_factory is not dataclasses.MISSING
            else field.default
        )
        value = getattr(cfg, field.name)
        if value != default:
            return field.name, value, default
    return None


def check_known_fields(cfg: ModelConfig) -> None:
    """Refuse a ModelConfig field this exporter does not know, unless it has its default.

    A feature added to the model later (a new norm, a bias) then stops the export with a
    ConfigError naming it, instead of being silently dropped from the written model.
    """
    unknown = first_unknown_field(cfg, set(ARCH_FIELDS) | set(TRAINING_FIELDS))
    if unknown is not None:
        name, value, default = unknown
        raise ConfigError(
            f"model.{name}",
            value,
            f"its default {default!r} for a Hugging Face export",
            "the exporter has no Hugging Face counterpart for this setting",
        )


def check_built_from(model: Transformer, cfg: ModelConfig) -> None:
    """Refuse a ``cfg`` that is not the config ``model`` was built from: config.json would
    then describe another model than the tensors written beside it."""
    differs = differing_field(cfg, model.cfg)
    if differs is not None:
        field, name = differs
        raise ConfigError(
            field,
            getattr(cfg, name),
            f"{getattr(model.cfg, name)!r}, as the model being exported was built",
            "pass the ModelConfig the model was built from",
        )


def function_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The values that decide the weights' shapes and meaning, keyed by config field."""
    values: dict[str, Any] = {
        "model.dim": cfg.dim,
        "model.n_layers": cfg.n_layers,
        "model.n_heads": cfg.n_heads,
        "model.n_kv_heads": cfg.kv_heads,
        "model.head_size": cfg.head_dim,
        "model.qk_norm": cfg.qk_norm,
        "model.norm_placement": cfg.norm_placement,
        "model.sliding_window": [cfg.layer_window(i) for i in range(cfg.n_layers)],
        "model.vocab_size": cfg.vocab_size,
        "model.rope_theta": cfg.rope_theta,
        "model.norm_eps": cfg.norm_eps,
        "model.tie_embeddings": cfg.tie_embeddings,
        "model.num_experts": cfg.num_experts,
        "model.zero_centered_norms": cfg.zero_centered_norms,
        "model.attention_scale_size": cfg.attention_scale_size or cfg.head_dim,
        "model.embedding_multiplier": cfg.embedding_multiplier,
        "model.rope_scaling": cfg.rope_scaling,
        "model.rope_scaling_factor": cfg.rope_scaling_factor,
        "model.rope_local_theta": cfg.rope_local_theta,
        "model.rope_yarn_mscale": cfg.rope_yarn_mscale,
        "model.rope_yarn_mscale_all_dim": cfg.rope_yarn_mscale_all_dim,
        "model.mla_kv_rank": cfg.mla_kv_rank,
        "model.mla_q_rank": cfg.mla_q_rank,
        "model.mla_nope_head_size": cfg.mla_nope_head_size,
        "model.mla_rope_head_size": cfg.mla_rope_head_size,
        "model.mla_value_head_size": cfg.mla_value_head_size,
    }
    if cfg.num_moe_layers < cfg.n_layers:
        values["model.ffn_hidden_dim"] = cfg.hidden_dim
        values["model.ffn_activation"] = cfg.ffn_activation
    if cfg.is_moe:
        values["model.moe_top_k"] = cfg.moe_top_k
        values["model.moe_router"] = cfg.moe_router
        values["model.moe_frequency"] = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
        values["model.moe_shared_experts"] = cfg.moe_shared_experts
        values["model.moe_expert_hidden_dim"] = cfg.expert_hidden_dim
        values["model.moe_num_groups"] = cfg.moe_num_groups
        values["model.moe_top_groups"] = cfg.moe_top_groups
        values["model.moe_routed_scaling"] = cfg.moe_routed_scaling
    return values


def differing_field(ours: ModelConfig, theirs: ModelConfig) -> tuple[str, str] | None:
    """The first function field (in name order) where two configs build different models,
    as (config field, ModelConfig attribute), e.g. ("model.dim", "dim"); None if none."""
    a, b = function_fields(ours), function_fields(theirs)
    for field in sorted(a.keys() | b.keys()):
        if a.get(field) != b.get(field):
            return field, field.split(".", 1)[1]
    return None


def check_same_model(job: ModelConfig, found: ModelConfig, folder: str | os.PathLike[str]) -> None:
    """Refuse a job config whose model differs from the folder's, naming the field."""
    differs = differing_field(job, found)
    if differs is not None:
        field, name = differs
        value = getattr(found, name)
        raise ConfigError(
            field,
            getattr(job, name),
            f"{value!r}, as the Hugging Face model {folder} has it",
            f"set --{field}={value} (kempnerforge import-hf writes the whole [model] table)",
        )
