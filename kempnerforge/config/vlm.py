"""[vision_encoder], [adapter] and [vlm]: the sections of a vision-language job.

A job is a VLM when it has a ``[vlm]`` table; ``[vlm]`` needs ``[vision_encoder]``, and
``[adapter]`` takes its defaults when omitted. The encoder's shape (image size, tokens per
image, feature width, pixel normalisation) is read here from the encoder's own config files
(``resolve_vision``), without importing torch or transformers, so a bad encoder directory
or an image size the tower cannot take fails at startup with the field that caused it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kempnerforge.config.checks import (
    MAX_SIZE,
    MAX_STEPS,
    check_at_least,
    check_choice,
    check_positive,
)
from kempnerforge.config.freeze import FreezeSpec, FreezeStage
from kempnerforge.core.errors import ConfigError, closest_name

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig

logger = logging.getLogger(__name__)

ENCODER_TYPES = ("random", "clip", "siglip")
ADAPTER_TYPES = ("mlp", "pool")
ACTIVATIONS = ("gelu", "silu", "relu")
VLM_ARCHS = ("joint_decoder", "cross_attention")
BAD_IMAGE_ACTIONS = ("skip", "fail")
FREEZE_GROUPS = ("encoder", "adapter", "decoder", "cross_attention")
"""The module groups a freeze list names: the vision encoder, the adapter (connector), the
language decoder (embedding, blocks, final norm, head) and the gated cross-attention blocks
(cross_attention arch only)."""

RANDOM_ENCODER_IMAGE_SIZE = 32
RANDOM_ENCODER_TOKENS = 16
RANDOM_ENCODER_DIM = 64
# Pixel normalisation when a tower's directory has no preprocessor_config.json: CLIP's
# published statistics, and SigLIP's (0.5, 0.5, 0.5).
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)
_HF_MODEL_TYPES = {"clip": "clip_vision_model", "siglip": "siglip_vision_model"}


@dataclass
class VisionEncoderConfig:
    type: str = "random"
    """'random': a patch embedding with fixed weights drawn from a constant seed (no
    download, for defaults and tests); 'clip' or 'siglip': the vision tower of a Hugging
    Face checkpoint in ``path``."""
    path: str = ""
    """Local directory of a Hugging Face CLIP or SigLIP checkpoint (config.json and
    model.safetensors; a whole CLIP/SigLIP model or its vision tower alone). Empty for
    'random'. Nothing is downloaded."""
    image_size: int = 0
    """Side of the square images the encoder takes, in pixels; 0 means the encoder's own
    (32 for 'random'). A Hugging Face tower takes only the size it was trained at."""
    feature_dim: int = 0
    """Width of the encoder's output tokens; 0 means the encoder's own (64 for 'random').
    Set for a Hugging Face tower, it must equal the tower's hidden size."""
    num_tokens: int = 0
    """Output tokens per image; 0 means the encoder's own (16 for 'random', a square
    number whose root divides image_size). Set for a Hugging Face tower, it must equal
    (image_size / patch_size) ** 2."""

    def __post_init__(self) -> None:
        check_choice("vision_encoder.type", self.type, ENCODER_TYPES)
        check_at_least("vision_encoder.image_size", self.image_size, 0, 16384)
        check_at_least("vision_encoder.feature_dim", self.feature_dim, 0, MAX_SIZE)
        check_at_least("vision_encoder.num_tokens", self.num_tokens, 0, MAX_SIZE)
        if self.type == "random" and self.path:
            raise ConfigError(
                "vision_encoder.path",
                self.path,
                "empty for vision_encoder.type = 'random'",
                "set vision_encoder.type to 'clip' or 'siglip' to load a tower",
            )
        if self.type != "random" and not self.path:
            raise ConfigError(
                "vision_encoder.path",
                self.path,
                f"a local directory of a Hugging Face {self.type} checkpoint",
            )


@dataclass
class AdapterConfig:
    type: str = "mlp"
    """'mlp': a 2-layer MLP applied to every image token; 'pool': average-pools each
    pool_window x pool_window square of the token grid first, so an image costs
    pool_window ** 2 times fewer tokens, then the same MLP."""
    hidden_dim: int = 0
    """Hidden width of the MLP; 0 means model.dim."""
    activation: str = "gelu"
    """Activation between the two layers: 'gelu', 'silu' or 'relu'."""
    pool_window: int = 2
    """Tokens pooled along each side of the grid by the 'pool' adapter; must divide the
    grid's side (sqrt of the encoder's tokens per image)."""

    def __post_init__(self) -> None:
        check_choice("adapter.type", self.type, ADAPTER_TYPES)
        check_at_least("adapter.hidden_dim", self.hidden_dim, 0, MAX_SIZE)
        check_choice("adapter.activation", self.activation, ACTIVATIONS)
        check_positive("adapter.pool_window", self.pool_window, 4096)


@dataclass
class VLMConfig:
    arch: str = "joint_decoder"
    """'joint_decoder': the adapted image tokens are prepended to the text in the
    decoder's sequence; 'cross_attention': the decoder sees text only, and gated
    cross-attention blocks (zero-initialised, so the model starts as the text model)
    attend to the image tokens."""
    max_text_len: int = 64
    """Text tokens per sample (captions are cut to it and padded to it); >= 2."""
    cross_attention_every_n_layers: int = 4
    """A gated cross-attention block follows decoder layer i when (i + 1) is a multiple of
    this (cross_attention arch)."""
    freeze: list[FreezeSpec] = field(default_factory=lambda: [FreezeSpec("encoder", True)])
    """The freeze state at step 0, by module group; groups not named train."""
    freeze_schedule: list[FreezeStage] = field(default_factory=list)
    """Freeze transitions, in increasing start_step order, each applied at exactly its
    step (also after a resume)."""
    data: str = ""
    """A jsonl index of image-text pairs, one {"image": path, "text": caption} object per
    line, image paths relative to the index's directory; empty means the built-in
    synthetic image-text data."""
    eval_data: str = ""
    """A jsonl index of held-out pairs for eval (same format); empty: with synthetic data
    a held-out synthetic set, with vlm.data no eval data."""
    bad_images: str = "skip"
    """What a sample whose image cannot be read or decoded does: 'skip' logs its path and
    takes the next readable sample in index order; 'fail' stops the run naming the file."""
    synthetic_samples: int = 4096
    """Samples in the built-in synthetic data (a held-out set of a quarter of that is
    drawn from other seeds)."""

    def __post_init__(self) -> None:
        check_choice("vlm.arch", self.arch, VLM_ARCHS)
        check_at_least("vlm.max_text_len", self.max_text_len, 2, MAX_SIZE)
        check_positive(
            "vlm.cross_attention_every_n_layers", self.cross_attention_every_n_layers, MAX_SIZE
        )
        check_choice("vlm.bad_images", self.bad_images, BAD_IMAGE_ACTIONS)
        check_positive("vlm.synthetic_samples", self.synthetic_samples, MAX_SIZE)
        groups = self.freeze_groups
        for i, spec in enumerate(self.freeze):
            _check_group(f"vlm.freeze[{i}].module", spec.module, groups)
        previous = 0
        for i, stage in enumerate(self.freeze_schedule):
            where = f"vlm.freeze_schedule[{i}]"
            check_at_least(f"{where}.start_step", stage.start_step, 1, MAX_STEPS)
            if stage.start_step <= previous:
                raise ConfigError(
                    f"{where}.start_step",
                    stage.start_step,
                    f"a step after the previous stage's ({previous})",
                    "stages are listed in increasing start_step order",
                )
            previous = stage.start_step
            if not stage.specs:
                raise ConfigError(f"{where}.specs", stage.specs, "at least one freeze spec")
            for j, spec in enumerate(stage.specs):
                _check_group(f"{where}.specs[{j}].module", spec.module, groups)

    @property
    def freeze_groups(self) -> tuple[str, ...]:
        """The module groups this architecture has."""
        if self.arch == "cross_attention":
            return FREEZE_GROUPS
        return tuple(g for g in FREEZE_GROUPS if g != "cross_attention")


def _check_group(field_name: str, module: str, groups: tuple[str, ...]) -> None:
    if module in groups:
        return
    if module == "cross_attention":
        raise ConfigError(
            field_name,
            module,
            "one of " + ", ".join(map(repr, groups)),
            "only vlm.arch = 'cross_attention' has cross-attention blocks",
        )
    suggestion = closest_name(module, groups)
    raise ConfigError(
        field_name,
        module,
        "one of " + ", ".join(map(repr, groups)),
        f"did you mean {suggestion!r}?" if suggestion else "",
    )


@dataclass(frozen=True)
class VisionSpec:
    """What the rest of the job needs to know about the encoder: its input and output."""

    image_size: int
    num_tokens: int
    feature_dim: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    patch_size: int
    hf_config: dict[str, Any] | None = None
    """The tower's own config (the vision part of config.json); None for 'random'."""

    @property
    def grid(self) -> int:
        """Tokens along each side of the image's token grid."""
        return math.isqrt(self.num_tokens)


def resolve_vision(cfg: VisionEncoderConfig) -> VisionSpec:
    """The encoder's shape: from the config for 'random', from the tower's config.json
    (and preprocessor_config.json, for the pixel statistics) for a Hugging Face tower.

    Raises ConfigError naming the vision_encoder field at fault: a directory that is
    missing or unreadable, a config of another model type, an image_size, feature_dim or
    num_tokens the tower does not have.
    """
    if cfg.type == "random":
        return _random_spec(cfg)
    hf = _read_tower_config(cfg)
    size, patch, width = hf.get("image_size"), hf.get("patch_size"), hf.get("hidden_size")
    if not all(isinstance(v, int) and v > 0 for v in (size, patch, width)):
        raise ConfigError(
            "vision_encoder.path",
            cfg.path,
            "a tower config with positive integer image_size, patch_size and hidden_size",
            f"{os.path.join(cfg.path, 'config.json')} has {size}, {patch}, {width}",
        )
    assert isinstance(size, int) and isinstance(patch, int) and isinstance(width, int)
    if cfg.image_size and cfg.image_size != size:
        raise ConfigError(
            "vision_encoder.image_size",
            cfg.image_size,
            f"{size} (or 0), the size this {cfg.type} tower was trained at",
            "its position embeddings cover exactly that grid; resize the images instead",
        )
    tokens = (size // patch) ** 2
    for name, value, own in (
        ("feature_dim", cfg.feature_dim, width),
        ("num_tokens", cfg.num_tokens, tokens),
    ):
        if value and value != own:
            raise ConfigError(f"vision_encoder.{name}", value, f"{own} (or 0), the tower's own")
    mean, std = _pixel_statistics(cfg)
    return VisionSpec(size, tokens, width, mean, std, patch, hf)


def _random_spec(cfg: VisionEncoderConfig) -> VisionSpec:
    size = cfg.image_size or RANDOM_ENCODER_IMAGE_SIZE
    tokens = cfg.num_tokens or RANDOM_ENCODER_TOKENS
    grid = math.isqrt(tokens)
    if grid * grid != tokens or size % grid:
        raise ConfigError(
            "vision_encoder.num_tokens",
            tokens,
            f"a square number whose root divides vision_encoder.image_size = {size}",
            "the random encoder cuts the image into a grid of equal square patches",
        )
    return VisionSpec(size, tokens, cfg.feature_dim or RANDOM_ENCODER_DIM, HALF, HALF, size // grid)


def _read_json(path: str, field_name: str, value: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(
            field_name, value, "a directory holding a Hugging Face checkpoint", f"no {path}"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            field_name, value, "a readable Hugging Face checkpoint", f"{path}: {e}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            field_name, value, "a Hugging Face config.json", f"{path} is not an object"
        )
    return data


def _read_tower_config(cfg: VisionEncoderConfig) -> dict[str, Any]:
    if not os.path.isdir(cfg.path):
        raise ConfigError(
            "vision_encoder.path",
            cfg.path,
            f"an existing local directory of a Hugging Face {cfg.type} checkpoint",
            "nothing is downloaded: save the model with save_pretrained and point here",
        )
    data = _read_json(os.path.join(cfg.path, "config.json"), "vision_encoder.path", cfg.path)
    nested = data.get("vision_config")
    vision: dict[str, Any] = nested if isinstance(nested, dict) else data
    expected = _HF_MODEL_TYPES[cfg.type]
    model_type = vision.get("model_type", data.get("model_type"))
    if model_type not in (expected, cfg.type):
        raise ConfigError(
            "vision_encoder.type",
            cfg.type,
            f"the type of the checkpoint in {cfg.path}",
            f"its config.json has model_type {model_type!r}",
        )
    return dict(vision)


Triple = tuple[float, float, float]


def _pixel_statistics(cfg: VisionEncoderConfig) -> tuple[Triple, Triple]:
    default = (CLIP_MEAN, CLIP_STD) if cfg.type == "clip" else (HALF, HALF)
    path = os.path.join(cfg.path, "preprocessor_config.json")
    if not os.path.exists(path):
        return default
    data = _read_json(path, "vision_encoder.path", cfg.path)
    mean, std = data.get("image_mean", default[0]), data.get("image_std", default[1])
    valid = all(
        isinstance(v, list | tuple) and len(v) == 3 and all(isinstance(x, int | float) for x in v)
        for v in (mean, std)
    )
    if not valid or min(std) <= 0:
        raise ConfigError(
            "vision_encoder.path",
            cfg.path,
            "image_mean and image_std of 3 numbers (std > 0) in preprocessor_config.json",
        )
    return _triple(mean), _triple(std)


def _triple(values: Any) -> Triple:
    a, b, c = (float(v) for v in values)
    return a, b, c


def check_job(config: JobConfig) -> None:
    """Every rule of a vision-language job that spans sections, in the order a user fixes
    them: the layouts and precisions it cannot take, then the encoder's shape against the
    adapter and the decoder (read here, so a bad tower directory or image size fails
    before anything is built), the token-data fields it has no use for, and a warning
    when eval is on without held-out pairs."""
    assert config.vlm is not None and config.adapter is not None
    _check_layout_and_precision(config)
    if config.eval.tasks:
        raise ConfigError(
            "eval.tasks",
            [task.name for task in config.eval.tasks],
            "none for a vision-language job",
            "downstream tasks score text with a text-only model",
        )
    model, vlm = config.model, config.vlm
    spec = config.vision_spec()
    if config.adapter.type == "pool" and spec.grid % config.adapter.pool_window:
        raise ConfigError(
            "adapter.pool_window",
            config.adapter.pool_window,
            f"a divisor of the encoder's token grid side {spec.grid}",
            f"the encoder gives {spec.num_tokens} tokens per image",
        )
    positions = config.decoder_positions(spec)
    if positions > model.max_seq_len:
        image = positions - vlm.max_text_len
        raise ConfigError(
            "vlm.max_text_len",
            vlm.max_text_len,
            f"<= model.max_seq_len - image tokens = {model.max_seq_len} - {image}",
            "the joint decoder's sequence is the image tokens then the text; raise "
            "model.max_seq_len or lower vlm.max_text_len",
        )
    data = config.data
    for field_name, value in (
        ("data.path", data.path),
        ("data.eval_path", data.eval_path),
        ("data.datasets", data.datasets),
        ("eval.sets", config.eval.sets),
    ):
        if value:
            raise ConfigError(
                field_name,
                value,
                "empty for a vision-language job ([vlm])",
                "it names token data; give image-text pairs with vlm.data and "
                "vlm.eval_data (jsonl indexes)",
            )
    if vlm.arch == "cross_attention" and vlm.cross_attention_every_n_layers > model.n_layers:
        raise ConfigError(
            "vlm.cross_attention_every_n_layers",
            vlm.cross_attention_every_n_layers,
            f"<= model.n_layers = {model.n_layers}",
            "otherwise no decoder layer is followed by a cross-attention block",
        )
    if config.eval.enabled and vlm.data and not vlm.eval_data:
        logger.warning(
            "eval.interval = %d but this job has no held-out data, so training skips eval: "
            "vlm.data is set and vlm.eval_data is empty; set vlm.eval_data to a jsonl index "
            "of held-out image-text pairs",
            config.eval.interval,
        )


def _check_layout_and_precision(config: JobConfig) -> None:
    """No pipeline stages, tensor-parallel shards or FP8 layers for a vision-language job."""
    dist = config.distributed
    for name, degree in (("pp", dist.pp), ("tp", dist.tp)):
        if degree > 1:
            raise ConfigError(
                f"distributed.{name}",
                degree,
                "1 for a vision-language model ([vlm])",
                "the vision encoder, the adapter and the cross-attention blocks are "
                "not split into pipeline stages or tensor-parallel shards; use "
                "distributed.dp_shard (FSDP) to spread a VLM over devices",
            )
    if config.train.float8:
        raise ConfigError(
            "train.float8",
            True,
            "false for a vision-language job ([vlm])",
            "FP8 linear layers cover the text models, dense and MoE",
        )
