"""What every Hugging Face decoder layout here shares with ours, and the checks around it.

Llama, Mixtral, Qwen2-MoE and GLM-4-MoE compute the same attention block as our Transformer,
so their embedding, attention, norm and head tensors map one to one:

- RoPE: both rotate the two halves of each head (channel i with channel i + head_dim / 2)
  with inverse frequencies theta ** (-2i / head_dim), so q and k need no permutation;
- RMSNorm: x * rsqrt(mean(x^2) + eps) * weight, computed in fp32, eps inside the root;
- attention: softmax(q k^T / sqrt(head_dim)) v, query head h reading key/value head
  h // (n_heads / n_kv_heads), no biases;
- SwiGLU: our w2(silu(w1 x) * w3 x) is down_proj(silu(gate_proj x) * up_proj x).

Both store nn.Linear weights as (out, in), so these tensors are copied, never transposed.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.hf_files import CONFIG_JSON, HFFolderError
from kempnerforge.model.transformer import Transformer, copy_full_tensor

ARCH_FIELDS = (
    "dim",
    "n_layers",
    "n_heads",
    "n_kv_heads",
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
)
"""ModelConfig fields that only change how the weights are trained; the exported model is
dropless (as our own generation is), whatever moe_capacity_factor says."""


# --- Our side: what can be exported -------------------------------------------------------


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


def check_known_fields(cfg: ModelConfig) -> None:
    """Refuse a ModelConfig field this exporter does not know, unless it has its default.

    A feature added to the model later (a new norm, a bias) then stops the export with a
    ConfigError naming it, instead of being silently dropped from the written model.
    """
    known = set(ARCH_FIELDS) | set(TRAINING_FIELDS)
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
            raise ConfigError(
                f"model.{field.name}",
                value,
                f"its default {default!r} for a Hugging Face export",
                "the exporter has no Hugging Face counterpart for this setting",
            )


def check_built_from(model: Transformer, cfg: ModelConfig) -> None:
    """Refuse a ``cfg`` that is not the config ``model`` was built from: config.json would
    then describe another model than the tensors written beside it."""
    built, given = function_fields(model.cfg), function_fields(cfg)
    for field in sorted(built.keys() | given.keys()):
        if built.get(field) != given.get(field):
            name = field.split(".", 1)[1]
            raise ConfigError(
                field,
                getattr(cfg, name),
                f"{getattr(model.cfg, name)!r}, as the model being exported was built",
                "pass the ModelConfig the model was built from",
            )


def special_ids_json(ids: dict[str, int]) -> dict[str, int | None]:
    """bos/eos/pad token ids for config.json (None when the tokenizer is unknown)."""
    return {k: ids.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def common_config_json(cfg: ModelConfig, special_ids: dict[str, int]) -> dict[str, Any]:
    """The config.json keys every layout here shares, from our config.

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
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "use_cache": True,
        "dtype": "float32",
        "torch_dtype": "float32",
        **special_ids_json(special_ids),
    }


def plain_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict as whole fp32 CPU tensors (a DTensor is gathered: collective)."""
    state = {}
    for name, value in model.state_dict().items():
        tensor = value.full_tensor() if isinstance(value, DTensor) else value
        state[name] = tensor.detach().to(device="cpu", dtype=torch.float32)
    return state


# --- Tensor names shared by every layout --------------------------------------------------


def outer_pairs(tied: bool) -> list[tuple[str, str]]:
    """(our name, Hugging Face name) of the embedding, final norm and (untied) head."""
    pairs = [
        ("tok_embeddings.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
    ]
    if not tied:
        pairs.append(("output.weight", "lm_head.weight"))
    return pairs


def block_pairs(index: int) -> list[tuple[str, str]]:
    """(our name, Hugging Face name) of layer ``index``'s attention and its two norms."""
    ours, hf = f"layers.{index}.", f"model.layers.{index}."
    pairs = [(f"{ours}attention.w{p}.weight", f"{hf}self_attn.{p}_proj.weight") for p in "qkvo"]
    pairs.append((f"{ours}attention_norm.weight", f"{hf}input_layernorm.weight"))
    pairs.append((f"{ours}ffn_norm.weight", f"{hf}post_attention_layernorm.weight"))
    return pairs


def swiglu_pairs(ours: str, hf: str) -> list[tuple[str, str]]:
    """(our name, HF name) of one SwiGLU: w1 = gate_proj, w3 = up_proj, w2 = down_proj."""
    return [
        (f"{ours}.w1.weight", f"{hf}.gate_proj.weight"),
        (f"{ours}.w3.weight", f"{hf}.up_proj.weight"),
        (f"{ours}.w2.weight", f"{hf}.down_proj.weight"),
    ]


def dense_ffn_pairs(index: int) -> list[tuple[str, str]]:
    """(our name, HF name) of the dense feed-forward of layer ``index``."""
    return swiglu_pairs(f"layers.{index}.feed_forward", f"model.layers.{index}.mlp")


def expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our state dict's tensor shapes for ``cfg``, from a model built on the meta device."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: value.shape for name, value in model.state_dict().items()}


class HFTensors:
    """The tensors of one folder, handed out by name with their shape checked.

    Every tensor taken is remembered, so ``check_all_used`` can refuse a folder that holds
    weights this layout would silently ignore (a bias, an extra layer).
    """

    def __init__(self, tensors: dict[str, torch.Tensor], folder: str | os.PathLike[str]) -> None:
        self.tensors = tensors
        self.folder = Path(folder)
        self.used: set[str] = set()

    def take(self, name: str, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """Tensor ``name`` as fp32, or an HFFolderError naming it when absent or mis-shaped."""
        tensor = self.tensors.get(name)
        if tensor is None:
            raise HFFolderError(
                self.folder,
                f"the tensor {name} is missing from the weights; the folder is incomplete "
                f"or its {CONFIG_JSON} describes another model",
            )
        if tuple(tensor.shape) != tuple(shape):
            raise HFFolderError(
                self.folder,
                f"the tensor {name} has shape {tuple(tensor.shape)}, but {CONFIG_JSON} "
                f"implies {tuple(shape)}",
            )
        self.used.add(name)
        return tensor.to(torch.float32)

    def ignore(self, name: str) -> None:
        """Mark ``name`` as known but not needed (a tied head saved anyway)."""
        if name in self.tensors:
            self.used.add(name)

    def check_all_used(self, ignore_prefixes: tuple[str, ...] = ()) -> None:
        """Refuse tensors no mapping took, except RoPE tables some folders carry and names
        starting with ``ignore_prefixes`` (layers past the decoder, for instance)."""
        left = sorted(
            n
            for n in self.tensors
            if n not in self.used
            and not n.endswith("rotary_emb.inv_freq")
            and not n.startswith(ignore_prefixes)
        )
        if left:
            raise HFFolderError(
                self.folder,
                f"holds {len(left)} tensors this layout has no place for (first: {left[0]}); "
                f"its {CONFIG_JSON} does not describe them, so the model cannot be imported "
                "exactly",
            )


def take_pairs(
    source: HFTensors,
    pairs: list[tuple[str, str]],
    shapes: dict[str, torch.Size],
    into: dict[str, torch.Tensor],
) -> None:
    """Copy each HF tensor of ``pairs`` into ``into`` under our name, shapes checked."""
    for ours, hf in pairs:
        into[ours] = source.take(hf, shapes[ours])


def tie_head(cfg: ModelConfig, state: dict[str, torch.Tensor], source: HFTensors) -> None:
    """A tied model's head is its embedding (a copy of lm_head in the folder is ignored)."""
    if cfg.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
        source.ignore("lm_head.weight")


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


def rope_theta(hf: HFConfig, partial_default: float = 1.0, theta_default: Any = 10000.0) -> float:
    """The RoPE base; refuses RoPE scaling and partial rotation, which our RoPE lacks.

    ``theta_default`` is used when config.json gives no base (None: required)."""
    params = hf.data.get("rope_parameters")
    scaling = hf.data.get("rope_scaling")
    if isinstance(params, dict):
        key, found = "rope_parameters", params
    elif isinstance(scaling, dict):
        key, found = "rope_scaling", scaling
    else:
        key, found = "rope_parameters", {}
    rope_type = found.get("rope_type", found.get("type", "default"))
    if rope_type not in (None, "default"):
        raise hf.error(
            key,
            f"RoPE type {rope_type!r} is not supported: kempnerforge's RoPE is the plain "
            "(default) one, without frequency scaling",
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


def common_model_fields(
    hf: HFConfig, *, llama_defaults: bool, partial_default: float = 1.0
) -> dict[str, Any]:
    """ModelConfig fields from the keys every layout shares; refuses what we cannot build.

    With ``llama_defaults`` an absent key takes Llama's long-standing default (key/value
    heads = heads, eps 1e-6, RoPE base 10000); otherwise the keys that decide the function
    must be present (save_pretrained always writes them), since class defaults differ.
    """
    dim, heads = hf.get_int("hidden_size"), hf.get_int("num_attention_heads")
    required: Any = _REQUIRED
    kv_heads = hf.get_int("num_key_value_heads", heads if llama_defaults else required)
    if heads <= 0 or dim % heads:
        raise hf.error("num_attention_heads", f"expected a divisor of hidden_size = {dim}")
    head_dim = hf.data.get("head_dim")
    if head_dim is not None and head_dim != dim // heads:
        raise hf.error(
            "head_dim",
            f"expected hidden_size / num_attention_heads = {dim // heads}: kempnerforge "
            "derives the head size from the width",
        )
    hf.require("hidden_act", "silu", "silu", "kempnerforge's feed-forward is SwiGLU (SiLU gate)")
    return {
        "dim": dim,
        "n_layers": hf.get_int("num_hidden_layers"),
        "n_heads": heads,
        "n_kv_heads": None if kv_heads == heads else kv_heads,
        "vocab_size": hf.get_int("vocab_size"),
        "max_seq_len": hf.get_int("max_position_embeddings", 2048),
        "rope_theta": rope_theta(hf, partial_default, 10000.0 if llama_defaults else None),
        "norm_eps": hf.get_float("rms_norm_eps", 1e-6 if llama_defaults else required),
        "tie_embeddings": hf.get_bool("tie_word_embeddings", False),
    }


def build_model_config(fields: dict[str, Any], hf: HFConfig) -> ModelConfig:
    """ModelConfig(**fields); a value our config refuses names the file it came from."""
    try:
        return ModelConfig(**fields)
    except ConfigError as e:
        raise HFFolderError(hf.path, f"describes a model kempnerforge cannot build: {e}") from None


# --- Loading into a built model -----------------------------------------------------------


def function_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The values that decide the weights' shapes and meaning, keyed by config field."""
    values: dict[str, Any] = {
        "model.dim": cfg.dim,
        "model.n_layers": cfg.n_layers,
        "model.n_heads": cfg.n_heads,
        "model.n_kv_heads": cfg.kv_heads,
        "model.vocab_size": cfg.vocab_size,
        "model.rope_theta": cfg.rope_theta,
        "model.norm_eps": cfg.norm_eps,
        "model.tie_embeddings": cfg.tie_embeddings,
        "model.num_experts": cfg.num_experts,
    }
    if cfg.num_moe_layers < cfg.n_layers:
        values["model.ffn_hidden_dim"] = cfg.hidden_dim
    if cfg.is_moe:
        values["model.moe_top_k"] = cfg.moe_top_k
        values["model.moe_router"] = cfg.moe_router
        values["model.moe_frequency"] = [cfg.is_moe_layer(i) for i in range(cfg.n_layers)]
        values["model.moe_shared_experts"] = cfg.moe_shared_experts
        values["model.moe_expert_hidden_dim"] = cfg.expert_hidden_dim
    return values


def check_same_model(job: ModelConfig, found: ModelConfig, folder: str | os.PathLike[str]) -> None:
    """Refuse a job config whose model differs from the folder's, naming the field."""
    ours, theirs = function_fields(job), function_fields(found)
    for field in ours.keys() | theirs.keys():
        if ours.get(field) != theirs.get(field):
            name = field.split(".", 1)[1]
            value = getattr(found, name)
            raise ConfigError(
                field,
                getattr(job, name),
                f"{value!r}, as the Hugging Face model {folder} has it",
                f"set --{field}={value} (kempnerforge import-hf writes the whole [model] table)",
            )


def copy_into(model: nn.Module, state: dict[str, torch.Tensor], folder: str) -> None:
    """Copy ``state`` into every tensor of ``model``'s state dict (a DTensor keeps its shard).

    A pipeline stage takes the layers it holds; a tensor the model has but ``state``
    lacks, or with another shape, is an HFFolderError naming it.
    """
    targets = model.state_dict(keep_vars=True)
    for name, target in targets.items():
        if name not in state:
            raise HFFolderError(folder, f"gives no value for the model's tensor {name}")
        if tuple(state[name].shape) != tuple(target.shape):
            raise HFFolderError(
                folder,
                f"gives {name} the shape {tuple(state[name].shape)}, the model has "
                f"{tuple(target.shape)}",
            )
    with torch.no_grad():
        for name, target in targets.items():
            copy_full_tensor(target, state[name])
