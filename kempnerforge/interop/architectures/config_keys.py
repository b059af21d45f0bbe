"""The config.json keys every architecture here shares, both ways: written from a ModelConfig,
and read back through HFConfig, whose checked reads name the key and the file at fault."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.hf_files import CONFIG_JSON, HFFolderError


def special_ids_json(ids: dict[str, int]) -> dict[str, int | None]:
    """bos/eos/pad token ids for config.json (None when the tokenizer is unknown)."""
    return {k: ids.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def common_config_json(cfg: ModelConfig, special_ids: dict[str, int]) -> dict[str, Any]:
    """The config.json keys every architecture here shares, from our config.

    RoPE is written both ways: ``rope_parameters`` (transformers 5) and ``rope_theta``
    (earlier releases); ``dtype`` and ``torch_dtype`` likewise name fp32.
    """
    return {
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": rope_parameters_json(cfg),
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",
        **special_ids_json(special_ids),
    }


def rope_parameters_json(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's ``rope_parameters``: the base, and YaRN's parameters under
    model.rope_scaling 'yarn' (its attention factor follows from the factor and, where
    set, DeepSeek's mscale and mscale_all_dim, so it is not written)."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    mscales = {
        key: value
        for key, value in (
            ("mscale", cfg.rope_yarn_mscale),
            ("mscale_all_dim", cfg.rope_yarn_mscale_all_dim),
        )
        if value
    }
    return {
        **mscales,
        "rope_type": cfg.rope_scaling,
        "rope_theta": cfg.rope_theta,
        "factor": cfg.rope_scaling_factor,
        "original_max_position_embeddings": cfg.rope_original_max_seq_len,
        "beta_fast": cfg.rope_yarn_beta_fast,
        "beta_slow": cfg.rope_yarn_beta_slow,
        "truncate": cfg.rope_yarn_truncate,
    }


# --- Reading config.json ------------------------------------------------------------------

_REQUIRED = object()


class HFConfig:
    """A config.json with typed, checked access: each bad value names its key and file."""

    def __init__(self, data: dict[str, Any], folder: str | os.PathLike[str]) -> None:
        self.data = data
        self.path = Path(folder) / CONFIG_JSON

    def error(self, key: str, problem: str) -> HFFolderError:
        return HFFolderError(self.path, f"{key} = {self.data.get(key)!r}: {problem}")

    def _get(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None and default is not _REQUIRED:
            return default
        return value

    def get_int(self, key: str, default: Any = _REQUIRED) -> int:
        value = self._get(key, default)
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.error(key, "expected an integer")
        return value

    def get_float(self, key: str, default: Any = _REQUIRED) -> float:
        value = self._get(key, default)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.error(key, "expected a number")
        if not math.isfinite(value):
            raise self.error(key, "expected a finite number")
        return float(value)

    def get_bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.error(key, "expected true or false")
        return value

    def require(self, key: str, allowed: Any, default: Any, why: str) -> None:
        """Refuse a value other than ``allowed``; an absent key counts as ``default``
        (None: the key must be present)."""
        value = self.data.get(key, default)
        if value != allowed:
            raise self.error(key, f"expected {allowed!r}: {why}")


def check_model_type(hf: HFConfig, model_type: str, architecture: str) -> None:
    """Refuse a folder whose model_type / architectures name another model."""
    found = hf.data.get("model_type")
    architectures = hf.data.get("architectures") or []
    if found != model_type:
        raise hf.error("model_type", f"expected {model_type!r} ({architecture})")
    if architectures and architecture not in architectures:
        raise HFFolderError(
            hf.path, f"architectures = {architectures!r}: expected [{architecture!r}]"
        )


def _rope_parameters(hf: HFConfig) -> tuple[str, dict[str, Any]]:
    """(the key, its dict) of config.json's RoPE parameters: ``rope_parameters``
    (transformers 5) or ``rope_scaling`` (earlier releases); an empty dict when neither."""
    params = hf.data.get("rope_parameters")
    scaling = hf.data.get("rope_scaling")
    if isinstance(params, dict):
        return "rope_parameters", params
    if isinstance(scaling, dict):
        return "rope_scaling", scaling
    return "rope_parameters", {}


def rope_theta(
    hf: HFConfig,
    partial_default: float = 1.0,
    theta_default: Any = 10000.0,
    scalings: tuple[str, ...] = (),
) -> float:
    """The RoPE base; refuses partial rotation, which our RoPE lacks, and RoPE scaling
    other than ``scalings`` (the types the class reads and rope_scaling_fields takes).

    ``theta_default`` is used when config.json gives no base (None: required)."""
    key, found = _rope_parameters(hf)
    rope_type = found.get("rope_type", found.get("type", "default"))
    if rope_type not in (None, "default", *scalings):
        supported = "".join(f" or {s!r}" for s in scalings)
        raise hf.error(
            key,
            f"RoPE type {rope_type!r} is not supported: kempnerforge's RoPE here is the "
            f"plain (default) one{supported}",
        )
    partial = found.get("partial_rotary_factor", hf.data.get("partial_rotary_factor"))
    if (partial_default if partial is None else partial) != 1.0:
        raise hf.error(
            key,
            f"partial_rotary_factor {partial_default if partial is None else partial} is not "
            "supported: kempnerforge rotates every channel of a head",
        )
    theta = found.get("rope_theta", hf.data.get("rope_theta", theta_default))
    if not isinstance(theta, int | float) or isinstance(theta, bool) or not theta > 0:
        raise hf.error(key, f"rope_theta {theta!r}: expected a number > 0")
    return float(theta)


YARN_UNSUPPORTED = ("attention_factor",)
"""YaRN keys that set the attention factor apart from the factor and mscales; our YaRN
derives it from those, so a config.json giving one is refused."""
YARN_MSCALES = ("mscale", "mscale_all_dim")
"""DeepSeek's YaRN keys (model.rope_yarn_mscale, model.rope_yarn_mscale_all_dim): read
by a class whose attention scales its logits by mscale_all_dim, refused by any other."""


def rope_scaling_fields(hf: HFConfig, *, yarn_mscales: bool = False) -> dict[str, Any]:
    """model.rope_scaling and its parameters from config.json's RoPE parameters (after
    rope_theta accepted their type): none, or YaRN's factor (absent: the ratio of
    max_position_embeddings to the original length, as transformers computes it),
    original length, betas and truncation; with ``yarn_mscales`` (DeepSeek) also its
    mscale and mscale_all_dim, which are refused otherwise."""
    key, found = _rope_parameters(hf)
    rope_type = found.get("rope_type", found.get("type", "default"))
    if rope_type in (None, "default"):
        return {}
    refused = YARN_UNSUPPORTED if yarn_mscales else YARN_UNSUPPORTED + YARN_MSCALES
    for name in refused:
        if found.get(name) is not None:
            raise hf.error(
                key,
                f"{name} = {found[name]!r} is not supported: kempnerforge's YaRN derives "
                "its attention factor from the factor (and DeepSeek's mscales, in "
                "DeepSeek-V3 alone)",
            )
    mscales = {
        f"rope_yarn_{name}": _rope_number(hf, key, name, found.get(name) or 0.0)
        for name in YARN_MSCALES
        if yarn_mscales
    }
    original = found.get("original_max_position_embeddings")
    if not isinstance(original, int) or isinstance(original, bool) or original < 1:
        raise hf.error(key, f"original_max_position_embeddings {original!r}: expected >= 1")
    factor = found.get("factor")
    if factor is None:
        factor = hf.get_int("max_position_embeddings") / original
    truncate = found.get("truncate")
    return {
        "rope_scaling": rope_type,
        "rope_scaling_factor": _rope_number(hf, key, "factor", factor),
        "rope_original_max_seq_len": original,
        "rope_yarn_beta_fast": _rope_number(hf, key, "beta_fast", found.get("beta_fast") or 32.0),
        "rope_yarn_beta_slow": _rope_number(hf, key, "beta_slow", found.get("beta_slow") or 1.0),
        "rope_yarn_truncate": True if truncate is None else truncate is True,
        **mscales,
    }


def _rope_number(hf: HFConfig, key: str, name: str, value: Any) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        raise hf.error(key, f"{name} {value!r}: expected a number")
    return float(value)


def common_model_fields(
    hf: HFConfig,
    *,
    llama_defaults: bool,
    partial_default: float = 1.0,
    explicit_head_dim: bool = False,
    own_activation_and_rope: bool = False,
    rope_scalings: tuple[str, ...] = (),
    yarn_mscales: bool = False,
) -> dict[str, Any]:
    """ModelConfig fields from the keys every architecture shares; refuses what we cannot build.

    With ``llama_defaults`` an absent key takes Llama's long-standing default (key/value
    heads = heads, eps 1e-6, RoPE base 10000); otherwise the keys that decide the function
    must be present (save_pretrained always writes them), since class defaults differ.
    With ``explicit_head_dim`` (a class whose attention reads config.json's head_dim) a
    head_dim other than hidden_size / num_attention_heads becomes model.head_size.
    ``rope_scalings`` are the RoPE scaling types the class reads (model.rope_scaling);
    any other is refused; ``yarn_mscales`` reads DeepSeek's YaRN mscales
    (rope_scaling_fields).
    With ``own_activation_and_rope`` the class names its activation and its RoPE in keys
    of its own (Gemma 3), which the caller reads: hidden_act and the RoPE keys are left
    to it, and no RoPE field is among those returned.
    """
    dim, heads = hf.get_int("hidden_size"), hf.get_int("num_attention_heads")
    required: Any = _REQUIRED
    kv_heads = hf.get_int("num_key_value_heads", heads if llama_defaults else required)
    head_size = _head_size(hf, dim, heads, explicit_head_dim)
    if not own_activation_and_rope:
        why = "kempnerforge's feed-forward is SwiGLU (SiLU gate)"
        hf.require("hidden_act", "silu", "silu", why)
    fields = {
        "dim": dim,
        "n_layers": hf.get_int("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": None if kv_heads == heads else kv_heads,
        "head_size": head_size,
        "vocab_size": hf.get_int("vocab_size"),
        "max_seq_len": hf.get_int("max_position_embeddings", 2048),
        "norm_eps": hf.get_float("rms_norm_eps", 1e-6 if llama_defaults else required),
        "tie_embeddings": hf.get_bool("tie_word_embeddings", False),
    }
    if not own_activation_and_rope:
        theta_default = 10000.0 if llama_defaults else None
        fields["rope_theta"] = rope_theta(hf, partial_default, theta_default, rope_scalings)
        fields.update(rope_scaling_fields(hf, yarn_mscales=yarn_mscales))
    return fields


def _head_size(hf: HFConfig, dim: int, heads: int, explicit: bool) -> int | None:
    """model.head_size of config.json's head_dim: None when it is absent or equals
    hidden_size / num_attention_heads; otherwise the value, if the class reads it."""
    head_dim = hf.data.get("head_dim")
    if head_dim is None or (heads > 0 and dim % heads == 0 and head_dim == dim // heads):
        if heads <= 0 or dim % heads:
            raise hf.error("num_attention_heads", f"expected a divisor of hidden_size = {dim}")
        return None
    if not explicit:
        derived = f" = {dim // heads}" if heads > 0 and dim % heads == 0 else ""
        raise hf.error(
            "head_dim",
            f"expected hidden_size / num_attention_heads{derived}: kempnerforge derives "
            "this class's head size from the width",
        )
    return hf.get_int("head_dim")


def build_model_config(fields: dict[str, Any], hf: HFConfig) -> ModelConfig:
    """ModelConfig(**fields); a value our config refuses names the file it came from."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise HFFolderError(hf.path, f"describes a model kempnerforge cannot build: {e}") from None
