"""Rotary position embedding: the cos/sin tables and their application to queries and keys."""

from __future__ import annotations

import torch


def rope_tables(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    device: torch.device | str | None = None,
    *,
    scaling: str = "none",
    factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Build the fp32 cos and sin tables, each of shape (max_seq_len, head_dim // 2).

    Row p holds the angles p * theta ** (-2i / head_dim) for i in [0, head_dim / 2). Positions
    count from the start of the sequence, not of each packed document, so a document's
    positions depend on where it sits in the window (the mask keeps documents apart).
    ``scaling`` (model.rope_scaling) 'linear' divides every inverse frequency by
    ``factor``: positions interpolated into the trained range.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling == "linear":
        inv_freq = inv_freq / factor
    elif scaling != "none":
        raise ValueError(f"unknown RoPE scaling {scaling!r}")
    positions = torch.arange(max_seq_len, dtype=torch.float32, device=device)
    angles = torch.outer(positions, inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (batch, seq, heads, head_dim) by the first seq rows of the tables.

    Half-split convention (as in Hugging Face Llama checkpoints): channel i is paired with
    channel i + head_dim / 2, not with its neighbour. The rotation runs in fp32 even if x
    is lower precision, and the result has x's dtype. The tables arrive in fp32 in every
    layout (a sharded block does not cast them to its bf16 compute dtype, see
    distributed/fsdp.py); a lower-precision table would round the angles.
    """
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c = cos[: x.shape[1]].float()[None, :, None, :]
    s = sin[: x.shape[1]].float()[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
