"""MXFP4 weights in a Hugging Face folder, turned back into float tensors on import.

The published GPT-OSS folders store each MoE layer's expert projections in the OCP
microscaling FP4 format (config.json ``quantization_config.quant_method = "mxfp4"``):
for a tensor ``X`` of logical shape (experts, out, in) the folder holds ``X_blocks``
(experts, out, in / 32, 16) bytes, two 4-bit values a byte (the low nibble first), and
``X_scales`` (experts, out, in / 32) bytes, one shared exponent per block of 32 values.
A 4-bit value is E2M1: bit 3 the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3,
4, 6; a block's values are multiplied by 2 ** (scale - 127). The float tensor a folder
saved by transformers in a float dtype holds is (experts, in, out): the transpose.

Every such value is exact in bf16 and fp32 (two mantissa bits, a power-of-two scale), so
the import is exact; we train and export in float (an exported folder is not quantized).
"""

from __future__ import annotations

from typing import Any

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The magnitudes of the 3-bit exponent-and-mantissa codes of an E2M1 value."""
SCALE_BIAS = 127
"""A block's scale byte s means a factor of 2 ** (s - 127) (E8M0)."""
BLOCK = 32
"""Values sharing one scale."""


def is_mxfp4(config: dict[str, Any]) -> bool:
    """Whether config.json says the folder's quantized tensors are MXFP4."""
    quantization = config.get("quantization_config")
    return isinstance(quantization, dict) and quantization.get("quant_method") == "mxfp4"


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 values of MXFP4 ``blocks`` (..., G, 16) bytes with ``scales`` (..., G): a
    tensor (..., G * 32), each byte's low nibble before its high one."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not "
            f"pair: expected blocks (..., G, {BLOCK // 2}) and scales (..., G)"
        )
    codes = blocks.to(torch.uint8)
    nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).flatten(-2).long()
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    values = table[nibbles & 0x07]
    values = torch.where((nibbles & 0x08).bool(), -values, values)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)


def dequantize_folder_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every ``X_blocks`` / ``X_scales`` pair replaced by ``X``, the float
    (experts, in, out) tensor a float folder holds under that name."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        scales = out.pop(f"{base}_scales", None)
        if scales is None:
            continue  # not an MXFP4 pair: left for the architecture to refuse by name
        values = dequantize(out.pop(name), scales)
        out[base] = values.transpose(-2, -1).contiguous()
    return out
