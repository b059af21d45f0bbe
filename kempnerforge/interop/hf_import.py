"""What `kempnerforge import-hf` writes from a Hugging Face folder: a [model] TOML table
that fixes every value the weights depend on, and a checkpoint step_0 that training
starts from with checkpoint.load_weights_only."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import tomli_w
import torch

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.loader import coerce, config_to_dict, parse_override
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.folders import staged
from kempnerforge.interop.hf import import_hf
from kempnerforge.interop.hf_model_checks import ARCH_FIELDS, TRAINING_FIELDS
from kempnerforge.interop.hf_state import copy_into
from kempnerforge.model.meta import on_meta
from kempnerforge.model.transformer import build_model

MODEL_TOML = "model.toml"
"""The [model] table import-hf writes."""
IMPORTED_STEP = 0
"""import-hf saves the weights as checkpoint step_<IMPORTED_STEP> of its output folder."""


def write_imported(source: Path, out: Path, overrides: list[str]) -> tuple[Path, Path]:
    """Write the [model] table and the step_0 checkpoint of the Hugging Face folder
    ``source`` into ``out`` (a folder new_folder accepted), whole or not at all; return
    the table's path and the checkpoint's. ``overrides`` are --model.<field>=... only."""
    model_cfg, state = import_hf(source)
    model_cfg = apply_model_overrides(model_cfg, overrides)
    with on_meta():
        model = build_model(model_cfg)
    model.to_empty(device="cpu")
    model.tie_head()
    model.reset_buffers()
    copy_into(model, state, str(source))
    with staged(out) as staging:
        (staging / MODEL_TOML).write_text(model_toml(model_cfg, source))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        extra = {"step": IMPORTED_STEP, "config": {"model": config_to_dict(model_cfg)}}
        extra["hf_source"] = str(source)
        CheckpointManager(CheckpointConfig(), str(staging)).save(
            IMPORTED_STEP,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            train_state={"extra": extra},
        )
    return out / MODEL_TOML, out / f"step_{IMPORTED_STEP}"


def model_fields(cfg: ModelConfig, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The [model] values that fix the weights (plus ``extra`` fields), none left implicit,
    so no preset included beside them can change the model."""
    skip = {"ffn_multiplier", "multiple_of"}  # ffn_hidden_dim is always explicit here
    if not cfg.is_moe:
        skip |= {n for n in ARCH_FIELDS if n.startswith("moe_")}
    values = {n: getattr(cfg, n) for n in (*ARCH_FIELDS, *extra) if n not in skip}
    values["n_kv_heads"] = cfg.kv_heads
    values["ffn_hidden_dim"] = cfg.hidden_dim
    if cfg.is_moe:
        values["moe_expert_hidden_dim"] = cfg.expert_hidden_dim
    return {k: v for k, v in values.items() if v is not None}


def model_toml(cfg: ModelConfig, source: Path) -> str:
    """model.toml: a comment naming the source, then the [model] table."""
    defaults = ModelConfig()
    changed = tuple(n for n in TRAINING_FIELDS if getattr(cfg, n) != getattr(defaults, n))
    table = tomli_w.dumps({"model": model_fields(cfg, changed)})
    return f"# The model of the Hugging Face folder {source} (kempnerforge import-hf).\n{table}"


def apply_model_overrides(cfg: ModelConfig, overrides: list[str]) -> ModelConfig:
    """``cfg`` with --model.<field>=... overrides; the fields the weights fix are refused."""
    hints = typing.get_type_hints(ModelConfig)
    changes: dict[str, Any] = {}
    for text in overrides:
        dotted, value = parse_override(text)
        section, _, name = dotted.partition(".")
        if section != "model" or name not in hints:
            raise ConfigError(
                "<override>",
                text,
                "--model.<field>=<value> naming a [model] field",
                "import-hf writes only the [model] table",
            )
        if name == "mtp_depth":
            changes[name] = _fewer_mtp_modules(cfg, coerce(hints[name], value, dotted))
            continue
        if name in ARCH_FIELDS and name != "max_seq_len":
            raise ConfigError(
                dotted,
                getattr(cfg, name),
                "no override: the Hugging Face weights fix this field",
                "only model.max_seq_len and the training settings of [model] may change",
            )
        changes[name] = coerce(hints[name], value, dotted)
    return dataclasses.replace(cfg, **changes)


def _fewer_mtp_modules(cfg: ModelConfig, depth: int) -> int:
    """An override of model.mtp_depth: at most the folder's, whose trailing MTP modules it
    drops (the training-only head; the next-token function stays the folder's)."""
    if not 0 <= depth <= cfg.mtp_depth:
        raise ConfigError(
            "model.mtp_depth",
            depth,
            f"0 to {cfg.mtp_depth}, the multi-token-prediction layers the folder holds",
            "import-hf can drop MTP modules, not create them",
        )
    return depth
