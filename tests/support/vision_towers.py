"""Tiny CLIP and SigLIP checkpoints, written by transformers' own classes into a test's
directory (nothing is downloaded): 32 x 32 images, 8 x 8 patches, width 32, 2 layers."""

from __future__ import annotations

import os

import torch

TINY_VISION = {
    "image_size": 32,
    "patch_size": 8,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
}
"""The tower's shape: 16 patch tokens of width 32 per image."""

TINY_TEXT = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 16,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The text side of a whole model: present in its checkpoint, never used by the encoder."""


def save_tiny_clip(
    directory: str | os.PathLike[str],
    *,
    whole_model: bool = False,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> str:
    """Save a random tiny CLIPVisionModel (or, with whole_model, a CLIPModel: text model,
    projections and logit_scale besides the tower) in ``dtype``; returns the directory."""
    from transformers import CLIPConfig, CLIPModel, CLIPVisionConfig, CLIPVisionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if whole_model:
            model = CLIPModel(CLIPConfig(vision_config=TINY_VISION, text_config=TINY_TEXT))
        else:
            model = CLIPVisionModel(CLIPVisionConfig(**TINY_VISION))
        _perturb(model)
    model.to(dtype).save_pretrained(directory)
    return str(directory)


def save_tiny_siglip(
    directory: str | os.PathLike[str], *, whole_model: bool = False, seed: int = 0
) -> str:
    """Save a random tiny SiglipVisionModel with its pooling head (or, with whole_model, a
    SiglipModel); returns the directory."""
    from transformers import SiglipConfig, SiglipModel, SiglipVisionConfig, SiglipVisionModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if whole_model:
            text = {k: v for k, v in TINY_TEXT.items() if not k.endswith("_token_id")}
            model = SiglipModel(SiglipConfig(vision_config=TINY_VISION, text_config=text))
        else:
            model = SiglipVisionModel(SiglipVisionConfig(**TINY_VISION, vision_use_head=True))
        _perturb(model)
    model.save_pretrained(directory)
    return str(directory)


@torch.no_grad()
def _perturb(model: torch.nn.Module) -> None:
    """Add noise to every parameter, so no tensor keeps a default value (zero biases, unit
    norm gains) that a tensor left unloaded could match by chance."""
    for param in model.parameters():
        param.add_(torch.randn_like(param) * 0.1)
