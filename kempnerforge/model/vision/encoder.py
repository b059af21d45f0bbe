"""The vision encoder of a vision-language model: images (batch, 3, S, S) -> image tokens
(batch, num_tokens, feature_dim), from a fixed random patch embedding or from the vision
tower of a local CLIP / SigLIP checkpoint, whose weights are read from its directory
(safetensors, or torch.load restricted to tensors) without executing anything from it."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from kempnerforge.config.registry import Registry
from kempnerforge.config.vlm import VisionEncoderConfig, VisionSpec
from kempnerforge.core.errors import ConfigError
from kempnerforge.model.weight_init import (
    copy_full_tensor,
    fill_parameter,
    parameter_seed,
    zero_parameter,
)

RANDOM_ENCODER_SEED = 20240917
"""Seed of the random encoder's weights: a constant, so every run, seed and layout sees the
same (untrained) features."""

CHECKPOINT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
"""The weight files a tower directory may hold, in the order they are looked for."""
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class VisionEncoder(nn.Module):
    """An image encoder that computes in its own parameter dtype, whatever the autocast.

    A pretrained tower keeps the dtype it was saved in (a bf16 tower computes in bf16, an
    fp32 one in fp32) also when the rest of the model runs under bf16 autocast or bf16
    FSDP gathers, so its features do not depend on the decoder's precision. Subclasses
    implement ``encode`` (pixels already in the encoder's dtype) and ``init_weights``.
    """

    def __init__(self, spec: VisionSpec) -> None:
        super().__init__()
        self.spec = spec
        """The image size and the token shape this encoder produces."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the encoder computes in: that of its parameters."""
        return next(self.parameters()).dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Image tokens (batch, spec.num_tokens, spec.feature_dim) in the encoder's dtype."""
        size = self.spec.image_size
        if pixel_values.ndim != 4 or tuple(pixel_values.shape[1:]) != (3, size, size):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}; the vision encoder "
                f"takes (batch, 3, {size}, {size}) (vision_encoder.image_size = {size})"
            )
        with torch.autocast(pixel_values.device.type, enabled=False):
            return self.encode(pixel_values.to(self.dtype))

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def init_weights(self) -> None:
        """Fill every parameter and buffer (after to_empty): the same values in every run."""
        raise NotImplementedError

    def fsdp_modules(self) -> list[nn.Module]:
        """The modules to shard as FSDP units, inner ones first; together they hold every
        parameter. Each returns a fresh tensor (not a view), as FSDP wants of a unit."""
        return [self]


EncoderBuilder = Callable[[VisionEncoderConfig, VisionSpec], VisionEncoder]
VISION_ENCODERS: Registry[EncoderBuilder] = Registry("vision_encoder.type")


def build_vision_encoder(cfg: VisionEncoderConfig, spec: VisionSpec) -> VisionEncoder:
    """The encoder ``cfg.type`` names, shaped by ``spec``, on the current default device.

    Its weights are not loaded or drawn here (the model may be on the meta device):
    init_weights() fills them, after to_empty() when built on meta.
    """
    return VISION_ENCODERS.get(cfg.type)(cfg, spec)


@VISION_ENCODERS.register("random")
class RandomPatchEncoder(VisionEncoder):
    """A ViT-style patch embedding with fixed random weights: Conv2d (kernel = stride =
    patch size), plus a position embedding per patch, then LayerNorm.

    Its weights come from a constant seed, so it needs no download and gives the same
    features in every run; it is a real module with parameters, so a freeze schedule can
    train it. The position embedding lets attention without positions (cross-attention)
    still tell the patches apart.
    """

    def __init__(self, cfg: VisionEncoderConfig, spec: VisionSpec) -> None:
        super().__init__(spec)
        dim, patch = spec.feature_dim, spec.patch_size
        self.patch_embedding = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        """One linear map per image patch: pixels -> feature_dim."""
        self.position_embedding = nn.Parameter(torch.empty(spec.num_tokens, dim))
        """A vector per patch position, added to the patch's features."""
        self.norm = nn.LayerNorm(dim)
        """Brings every token to unit scale."""

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return self.norm(patches + self.position_embedding)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Draw the weights from RANDOM_ENCODER_SEED: the patch map with std 1/sqrt(fan-in)
        (unit-scale features from unit-scale pixels), positions at the same scale, zero
        biases, unit norm gain."""
        fan_in = 3 * self.spec.patch_size**2
        stds = {"patch_embedding.weight": fan_in**-0.5, "position_embedding": 1.0}
        for name, param in self.named_parameters():
            if name.endswith("bias"):
                zero_parameter(param)
            else:
                fill_parameter(param, stds.get(name), parameter_seed(RANDOM_ENCODER_SEED, name))


class PretrainedTower(VisionEncoder):
    """The vision tower of a CLIP or SigLIP checkpoint in a local directory.

    Built from the tower's config alone, so it can be created on the meta device; its
    weights are read from the directory by init_weights(). CLIP's class token is dropped
    from the output (one token per patch); SigLIP has none and runs without its pooling
    head.
    """

    def __init__(self, cfg: VisionEncoderConfig, spec: VisionSpec) -> None:
        super().__init__(spec)
        if spec.hf_config is None:
            raise ValueError(f"vision_encoder.type = {cfg.type!r} needs the tower's config")
        self.kind = cfg.type
        """'clip' or 'siglip'."""
        self.path = cfg.path
        """The checkpoint directory init_weights() reads."""
        dtype = tower_dtype(cfg, spec.hf_config)
        self.tower = _build_tower(cfg.type, spec.hf_config).to(dtype)
        """The transformers vision model, in the dtype of its checkpoint's config."""

    def encode(self, pixel_values: torch.Tensor) -> torch.Tensor:
        hidden = self.tower(pixel_values=pixel_values).last_hidden_state
        return hidden[:, 1:] if self.kind == "clip" else hidden

    @torch.no_grad()
    def init_weights(self) -> None:
        """Load the tower's weights from ``path`` and recompute its position ids."""
        load_tower_weights(self.tower, self.path)
        reset_position_ids(self.tower)

    def fsdp_modules(self) -> list[nn.Module]:
        """Each transformer layer of the tower, then the tower itself (its embeddings and
        norms); the class-token slice in encode() stays outside the units."""
        return [*self.blocks(), self.tower]

    def blocks(self) -> list[nn.Module]:
        """The tower's transformer layers, in order."""
        for name, module in self.tower.named_modules():
            if name.endswith("encoder.layers") and isinstance(module, nn.ModuleList):
                return list(module)
        return []


VISION_ENCODERS.register("clip")(PretrainedTower)
VISION_ENCODERS.register("siglip")(PretrainedTower)


def _build_tower(kind: str, hf_config: dict[str, Any]) -> nn.Module:
    """A CLIPVisionModel / SiglipVisionModel from the tower's config dict, uninitialized
    weights on the current device; SDPA attention where the class supports it."""
    from transformers import (
        CLIPVisionConfig,
        CLIPVisionModel,
        SiglipVisionConfig,
        SiglipVisionModel,
    )

    classes: dict[str, tuple[Any, Any]] = {
        "clip": (CLIPVisionConfig, CLIPVisionModel),
        "siglip": (SiglipVisionConfig, SiglipVisionModel),
    }
    config_class, model_class = classes[kind]
    fields = dict(hf_config)
    sdpa = getattr(model_class, "_supports_sdpa", False)
    fields["attn_implementation"] = "sdpa" if sdpa else "eager"
    if kind == "siglip":
        fields["vision_use_head"] = False  # the pooled output is unused: only the tokens
    return model_class(config_class(**fields))


def tower_dtype(cfg: VisionEncoderConfig, hf_config: dict[str, Any]) -> torch.dtype:
    """The dtype the checkpoint's config.json declares (``dtype``, or ``torch_dtype`` in
    older files), in the vision config or at the top level; float32 when it names none.

    The top level counts because a whole CLIP/SigLIP model records its dtype only there.
    """
    path = os.path.join(cfg.path, "config.json")
    top: dict[str, Any] = {}
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
        top = loaded if isinstance(loaded, dict) else {}
    for source in (hf_config, top):
        name = source.get("dtype") or source.get("torch_dtype")
        if name is None or name == "auto":
            continue
        if name not in _DTYPES:
            raise ConfigError(
                "vision_encoder.path",
                cfg.path,
                "a checkpoint whose config.json dtype is one of " + ", ".join(_DTYPES),
                f"{path} has dtype {name!r}",
            )
        return _DTYPES[name]
    return torch.float32


def reset_position_ids(tower: nn.Module) -> None:
    """Recompute every non-persistent ``position_ids`` buffer (0, 1, ..., n - 1).

    These buffers are not in the checkpoint, and to_empty() leaves them uninitialized, so
    without this the tower would look up garbage positions. Any other non-persistent
    buffer is an unknown one that nothing would restore, hence an error.
    """
    for module_name, module in tower.named_modules():
        for name in list(module._non_persistent_buffers_set):  # noqa: SLF001
            buffer = module._buffers.get(name)  # noqa: SLF001
            if buffer is None:
                continue
            if name != "position_ids":
                raise RuntimeError(
                    f"vision tower buffer {module_name}.{name} is not saved in checkpoints "
                    "and has no known value to restore after to_empty()"
                )
            positions = torch.arange(buffer.shape[-1], dtype=buffer.dtype, device=buffer.device)
            setattr(module, name, positions.expand(buffer.shape).contiguous())


def load_tower_weights(tower: nn.Module, directory: str) -> None:
    """Copy every parameter and saved buffer of ``tower`` from the checkpoint in
    ``directory``; sharded (DTensor) parameters receive their own shard.

    The checkpoint may be the tower alone or a whole CLIP/SigLIP model: when its names
    start with ``vision_model.`` only those are read, so the text model, the projections,
    logit_scale and SigLIP's head are ignored. Raises ConfigError naming the tensor, the
    file and the expected shape when a tensor is missing or has another shape.
    """
    reader = CheckpointTensors(directory)
    prefix = "vision_model." if any(k.startswith("vision_model.") for k in reader.names()) else ""
    for name, tensor in _saved_tensors(tower):
        key = prefix + name.removeprefix("vision_model.")
        expected = tuple(tensor.shape)
        if key not in reader:
            raise _weights_error(
                directory, f"{reader.file_of(key)} has no tensor {key!r} (shape {expected})"
            )
        full = reader.get(key)
        if tuple(full.shape) != expected:
            raise _weights_error(
                directory,
                f"tensor {key!r} in {reader.file_of(key)} has shape {tuple(full.shape)}, "
                f"the tower's config gives {expected}",
            )
        copy_full_tensor(tensor, full)


def _weights_error(directory: str, problem: str) -> ConfigError:
    return ConfigError(
        "vision_encoder.path",
        directory,
        "a checkpoint holding every tensor of the vision tower its config.json describes",
        problem,
    )


def _saved_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state-dict name, tensor) of every parameter and persistent buffer of ``module``."""
    tensors: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    for module_name, owner in module.named_modules():
        for name, buffer in owner._buffers.items():  # noqa: SLF001
            if buffer is not None and name not in owner._non_persistent_buffers_set:  # noqa: SLF001
                tensors.append((f"{module_name}.{name}" if module_name else name, buffer))
    return tensors


class CheckpointTensors:
    """The tensors of a checkpoint directory by name, each read from disk when asked for.

    Reads model.safetensors, the shards a model.safetensors.index.json lists, or else
    pytorch_model.bin through torch.load(weights_only=True), which unpickles tensors only.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[str, str] = {}
        """Tensor name -> the file holding it."""
        self._open: dict[str, Any] = {}
        """File -> its open safetensors handle, or its loaded dict for a .bin file."""
        found = next(
            (f for f in CHECKPOINT_FILES if os.path.isfile(os.path.join(directory, f))), None
        )
        if found is None:
            raise ConfigError(
                "vision_encoder.path",
                directory,
                "a directory holding " + " or ".join(CHECKPOINT_FILES),
                "save the tower or the whole model there with save_pretrained",
            )
        self.description = os.path.join(directory, found)
        """The file (or index) the tensors come from, for messages."""
        if found.endswith(".index.json"):
            self._read_index(self.description)
        else:
            names = self._handle(self.description).keys()
            self._files.update(dict.fromkeys(names, self.description))

    def _read_index(self, path: str) -> None:
        try:
            with open(path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            items = [(str(k), os.path.join(self.directory, str(v))) for k, v in weight_map.items()]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise _weights_error(self.directory, f"{path} is not a weight index: {e}") from None
        self._files.update(items)

    def _handle(self, path: str) -> Any:
        if path not in self._open:
            self._open[path] = _open_weights(self.directory, path)
        return self._open[path]

    def names(self) -> list[str]:
        """Every tensor name in the checkpoint."""
        return list(self._files)

    def __contains__(self, key: str) -> bool:
        return key in self._files

    def file_of(self, key: str) -> str:
        """The file holding ``key``; the checkpoint's main file for a missing one."""
        return self._files.get(key, self.description)

    def get(self, key: str) -> torch.Tensor:
        """The whole tensor ``key``, on the CPU."""
        handle = self._handle(self._files[key])
        tensor = handle[key] if isinstance(handle, dict) else handle.get_tensor(key)
        if not isinstance(tensor, torch.Tensor):
            raise _weights_error(self.directory, f"{self._files[key]}: {key!r} is not a tensor")
        return tensor


def _open_weights(directory: str, path: str) -> Any:
    """A safetensors handle for ``path``, or the tensor dict of a torch .bin file."""
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            return safe_open(path, framework="pt", device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # safetensors and torch.load raise several unrelated types
        raise _weights_error(directory, f"cannot read {path}: {e}") from None
    if not isinstance(state, dict):
        raise _weights_error(directory, f"{path} holds a {type(state).__name__}, not tensors")
    return state
