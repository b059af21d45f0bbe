"""`kempnerforge export` and `kempnerforge import-hf`: checkpoints to and from Hugging Face.

export: checkpoint -> its run's config -> the model built on CPU -> the checkpoint's weights
-> a Hugging Face folder. import-hf: a Hugging Face folder -> a [model] TOML table and a
weights-only checkpoint that `kempnerforge train` starts from. Both run in one process and
write their folder under a temporary name first, so a failure leaves no half-written model.
Heavy imports stay inside the functions, so `kempnerforge --help` stays fast.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kempnerforge.config.run_config import RUN_CONFIG_FILE, run_config_beside
from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig
    from kempnerforge.config.model import ModelConfig

EXPORT_FORMATS = ("hf",)
MODEL_TOML = "model.toml"
"""The [model] table import-hf writes."""
IMPORTED_STEP = 0
"""import-hf saves the weights as checkpoint step_0 of its output folder."""


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge export` (overrides are the unknown --section.field=...)."""
    parser.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint directory (runs/<name>/checkpoints/step_<N>)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help="the folder to write, new or empty: config.json, model.safetensors and the "
        "tokenizer files when data.tokenizer is a Hugging Face tokenizer",
    )
    parser.add_argument(
        "--format",
        choices=EXPORT_FORMATS,
        default="hf",
        help="hf: a Hugging Face transformers folder (LlamaForCausalLM for a dense model; "
        "MixtralForCausalLM, Qwen2MoeForCausalLM or Glm4MoeForCausalLM for an MoE model)",
    )
    parser.add_argument(
        "--config",
        default="",
        help=f"the run's TOML config (default: {RUN_CONFIG_FILE} of the run directory two "
        "levels above --checkpoint, else the config recorded in the checkpoint)",
    )


def add_import_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge import-hf` (overrides: --model.<field>=... only)."""
    parser.add_argument(
        "--model",
        required=True,
        help="a Hugging Face model folder with config.json and safetensors weights "
        "(Llama, Mixtral, Qwen2-MoE or GLM-4-MoE)",
    )
    parser.add_argument(
        "--out",
        required=True,
        help=f"the folder to write, new or empty: {MODEL_TOML} (the [model] table) and "
        f"step_{IMPORTED_STEP}, a checkpoint to start training from with "
        "--checkpoint.resume_from=<out>/step_0 --checkpoint.load_weights_only=true",
    )


# --- export ---------------------------------------------------------------------------------


def run_export(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write the weights of ``args.checkpoint`` as a Hugging Face folder at ``args.out``; 0."""
    import torch

    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.config.checkpoint import CheckpointConfig
    from kempnerforge.interop.hf import export_hf, hf_architecture
    from kempnerforge.model.transformer import build_model

    checkpoint = _existing_checkpoint(args.checkpoint)
    out = _new_folder(args.out)
    manager = CheckpointManager(CheckpointConfig(), str(checkpoint.parent))
    extra = manager.read_extra(str(checkpoint))  # a CheckpointError when incomplete
    saved = extra.get("config")
    config, source = export_config(checkpoint, args.config, overrides, saved)
    if config.is_vlm:
        raise ConfigError(
            "vlm",
            "[vlm]",
            "a text-only job (no [vlm] table)",
            "the Hugging Face export writes causal language models; a vision-language "
            "model's encoder, adapter and cross-attention blocks have no place in them",
        )
    check_recorded_model(config.model, saved, str(checkpoint))
    architecture = hf_architecture(config.model)  # refuse before reading any weights
    # Built on meta and materialized without drawing weights: the load overwrites them all
    # (DCP refuses a checkpoint that lacks any), so only the RoPE tables need computing.
    with torch.device("meta"):
        model = build_model(config.model)
    model.to_empty(device="cpu")
    model.tie_head()
    model.reset_buffers()
    manager.load_weights(str(checkpoint), model=model)
    model.eval()
    with _staged(out) as staging:
        export_hf(model, config.model, staging, config.data.tokenizer)
    print(f"wrote {out} ({architecture}) from {checkpoint}, step {extra.get('step')}")
    print(f"config: {source}")
    return 0


def export_config(
    checkpoint: Path, config_path: str, overrides: list[str], saved: Any
) -> tuple[JobConfig, str]:
    """The job config to rebuild the model from, and where it came from.

    --config when given, else <run_dir>/config.toml, else the config the checkpoint
    recorded at save time; overrides apply on top of each.
    """
    import tempfile

    from kempnerforge.config.loader import load_config

    if config_path:
        return load_config(config_path, overrides), config_path
    run_config = run_config_beside(checkpoint)
    if run_config.is_file():
        return load_config(str(run_config), overrides), str(run_config)
    if not isinstance(saved, dict):
        raise ConfigError(
            "--config",
            "",
            "the TOML config of the run that saved the checkpoint",
            f"{run_config} does not exist and {checkpoint} records no config",
        )
    import tomli_w

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, RUN_CONFIG_FILE)
        with open(path, "w") as f:
            f.write(tomli_w.dumps(saved))
        config = load_config(path, overrides)
    return config, f"the config recorded in {checkpoint}"


def check_recorded_model(model_cfg: ModelConfig, saved: Any, checkpoint: str) -> None:
    """Refuse a config whose model computes another function than the one the checkpoint
    was trained as (a stale config.toml, a wrong override), naming the field."""
    from kempnerforge.config.loader import build_dataclass
    from kempnerforge.config.model import ModelConfig
    from kempnerforge.interop.hf_layout import function_fields

    recorded = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(recorded, dict):
        return
    try:
        trained = build_dataclass(ModelConfig, recorded, prefix="model.")
    except ConfigError:
        return  # recorded by a release with other fields: the weight load still checks shapes
    ours, theirs = function_fields(model_cfg), function_fields(trained)
    for field in sorted(ours.keys() | theirs.keys()):
        if ours.get(field) != theirs.get(field):
            name = field.split(".", 1)[1]
            raise ConfigError(
                field,
                getattr(model_cfg, name),
                f"{getattr(trained, name)!r}, the value {checkpoint} was trained with",
                "the weights compute another model under this value; fix --config or "
                "drop the override",
            )


# --- import-hf ------------------------------------------------------------------------------


def run_import(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write the [model] table and a step_0 checkpoint of the Hugging Face folder; 0."""
    import torch

    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.config.checkpoint import CheckpointConfig
    from kempnerforge.config.loader import config_to_dict
    from kempnerforge.interop.hf import import_hf
    from kempnerforge.interop.hf_layout import copy_into
    from kempnerforge.model.transformer import build_model

    source = Path(args.model).resolve()
    model_cfg, state = import_hf(source)
    model_cfg = apply_model_overrides(model_cfg, overrides)
    out = _new_folder(args.out)
    with torch.device("meta"):
        model = build_model(model_cfg)
    model.to_empty(device="cpu")
    model.tie_head()
    model.reset_buffers()
    copy_into(model, state, str(source))
    with _staged(out) as staging:
        with open(staging / MODEL_TOML, "w") as f:
            f.write(model_toml(model_cfg, source))
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
    toml, step = out / MODEL_TOML, out / f"step_{IMPORTED_STEP}"
    print(f"wrote {toml} and the checkpoint {step} from {source}")
    print(
        f'train from it: include = ["{toml.resolve()}"] in a config (or copy its [model] table), '
        f"then kempnerforge train CONFIG --checkpoint.resume_from={step} "
        "--checkpoint.load_weights_only=true"
    )
    if (source / "tokenizer.json").is_file():
        print(f'its tokenizer: data.tokenizer = "{source}" (prepare data with it)')
    return 0


def model_fields(cfg: ModelConfig, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The [model] values that fix the weights (plus ``extra`` fields), none left implicit,
    so no preset included beside them can change the model."""
    from kempnerforge.interop.hf_layout import ARCH_FIELDS

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
    import tomli_w

    from kempnerforge.config.model import ModelConfig
    from kempnerforge.interop.hf_layout import TRAINING_FIELDS

    defaults = ModelConfig()
    changed = tuple(n for n in TRAINING_FIELDS if getattr(cfg, n) != getattr(defaults, n))
    table = tomli_w.dumps({"model": model_fields(cfg, changed)})
    return f"# The model of the Hugging Face folder {source} (kempnerforge import-hf).\n{table}"


def apply_model_overrides(cfg: ModelConfig, overrides: list[str]) -> ModelConfig:
    """``cfg`` with --model.<field>=... overrides; the fields the weights fix are refused."""
    import dataclasses
    import typing

    from kempnerforge.config.loader import coerce, parse_override
    from kempnerforge.config.model import ModelConfig
    from kempnerforge.interop.hf_layout import ARCH_FIELDS

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
        if name in ARCH_FIELDS and name != "max_seq_len":
            raise ConfigError(
                dotted,
                getattr(cfg, name),
                "no override: the Hugging Face weights fix this field",
                "only model.max_seq_len and the training settings of [model] may change",
            )
        changes[name] = coerce(hints[name], value, dotted)
    return dataclasses.replace(cfg, **changes)


# --- Folders --------------------------------------------------------------------------------


def _existing_checkpoint(path: str) -> Path:
    checkpoint = Path(path)
    if not checkpoint.is_dir():
        raise ConfigError(
            "--checkpoint",
            path,
            "an existing checkpoint directory (runs/<name>/checkpoints/step_<N>)",
        )
    return checkpoint


def _new_folder(path: str) -> Path:
    """``path`` as the folder to write: it must not exist, or be an empty directory."""
    folder = Path(path)
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        raise ConfigError(
            "--out",
            path,
            "a new or empty directory",
            "it already holds files; choose another path or remove them",
        )
    return folder


class _staged:
    """Context manager: a sibling ``<out>.partial`` folder renamed to ``out`` on success and
    removed on failure, so ``out`` never holds a half-written model."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.staging = out.with_name(out.name + ".partial")

    def __enter__(self) -> Path:
        if self.staging.exists():
            shutil.rmtree(self.staging)  # left by an earlier failed attempt
        self.staging.mkdir(parents=True)
        return self.staging

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if kind is not None:
            shutil.rmtree(self.staging, ignore_errors=True)
            return
        if self.out.exists():
            self.out.rmdir()  # empty (checked by _new_folder)
        os.replace(self.staging, self.out)
