"""Model FLOPs utilization: peak throughput per device and precision, and the MFU ratio."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from kempnerforge.core.logging import get_logger

logger = get_logger(__name__)


class DevicePeaks(NamedTuple):
    """Dense (no structured sparsity) peak FLOP/s of one device per matmul dtype; None where
    no vendor figure is known."""

    bf16: float | None
    """bf16 tensor cores with fp32 accumulation, which is what PyTorch's bf16 matmuls use."""
    tf32: float | None
    """TF32 tensor cores: fp32 matmuls when torch.backends.cuda.matmul.allow_tf32 is set."""
    fp32: float | None
    """Plain fp32 (CUDA cores): fp32 matmuls without TF32."""


# From the vendors' datasheets and architecture whitepapers; the tensor-core figures there
# are quoted with 2:4 sparsity, and the dense ones here are half of them. Matched as
# substrings of the CUDA device name, first match wins, so the more specific names come
# before the families they belong to. None where the datasheet gives no figure we trust.
PEAK_FLOPS: tuple[tuple[str, DevicePeaks], ...] = (
    ("GH200", DevicePeaks(989e12, 494.7e12, 67e12)),
    ("H200 NVL", DevicePeaks(835e12, 417.5e12, 60e12)),
    ("H200", DevicePeaks(989e12, 494.7e12, 67e12)),  # SXM
    ("H100 PCIe", DevicePeaks(756e12, 378e12, 51e12)),
    ("H100 NVL", DevicePeaks(835e12, 417.5e12, 60e12)),
    ("H100", DevicePeaks(989e12, 494.7e12, 67e12)),  # SXM
    ("H800", DevicePeaks(989e12, None, None)),
    ("A100", DevicePeaks(312e12, 156e12, 19.5e12)),
    ("A800", DevicePeaks(312e12, 156e12, 19.5e12)),
    ("L40S", DevicePeaks(362e12, 183e12, 91.6e12)),
    ("A10G", DevicePeaks(125e12, None, None)),
    # GeForce bf16 with fp32 accumulation; the twice-larger figures quoted first are for
    # fp16 with fp16 accumulation, not reachable in bf16.
    ("RTX 4090", DevicePeaks(165e12, 82.6e12, 82.6e12)),
    ("RTX 3090", DevicePeaks(71e12, 35.6e12, 35.6e12)),
)

# Unknown names fall back by compute capability only where one capability means one class of
# datacenter part; consumer capabilities (8.6, 8.9, ...) span a 5x range of peaks, so they
# get no MFU rather than a guess.
PEAK_FLOPS_BY_CAPABILITY: dict[tuple[int, int], DevicePeaks] = {
    (8, 0): DevicePeaks(312e12, 156e12, 19.5e12),  # A100 class
    (9, 0): DevicePeaks(989e12, 494.7e12, 67e12),  # H100 SXM class
}

PRECISIONS = ("bf16", "fp32")


def peak_flops_per_sec(device: torch.device, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of one device for train.mixed_precision ``precision``, or None
    where no honest figure is known.

    'bf16' uses the bf16 tensor-core peak; 'fp32' the TF32 tensor-core peak when
    torch.backends.cuda.matmul.allow_tf32 is true, else the plain fp32 peak (read at each
    call, so set it first). None on CPU, on CUDA devices that are neither in the table nor of
    a datacenter compute capability, and where the table has no figure for that dtype; the
    tracker then omits MFU instead of reporting it against a made-up peak.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    if precision == "bf16":
        dtype = "bf16"
    else:
        dtype = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    capability = torch.cuda.get_device_capability(index)
    return _peak_for(name, capability, dtype)


@functools.cache
def _peak_for(name: str, capability: tuple[int, int], dtype: str) -> float | None:
    """Table lookup by name, then by capability; cached so each device and dtype warns once."""
    for key, peaks in PEAK_FLOPS:
        if key.lower() in name.lower():
            peak = getattr(peaks, dtype)
            if peak is None:
                logger.warning("no %s peak known for %r; MFU is not reported", dtype, name)
            return peak
    fallback = PEAK_FLOPS_BY_CAPABILITY.get(capability)
    peak = None if fallback is None else getattr(fallback, dtype)
    if peak is None:
        logger.warning(
            "no %s peak known for %r (compute capability %d.%d); MFU is not reported",
            dtype,
            name,
            *capability,
        )
    else:
        logger.warning(
            "no %s peak known for %r; assuming %.0f TFLOP/s from compute capability %d.%d",
            dtype,
            name,
            peak / 1e12,
            *capability,
        )
    return peak


def mfu(tokens_per_sec: float, flops_per_token: float, peak: float) -> float:
    """Achieved model FLOP/s as a fraction of the peak (0.41 means 41%).

    `peak` must cover the same devices as `tokens_per_sec`: a per-device peak for per-rank
    tokens, that peak times the world size for tokens counted over all ranks.
    """
    if peak <= 0:
        raise ValueError(f"peak FLOP/s must be > 0, got {peak}")
    return tokens_per_sec * flops_per_token / peak
