"""Model FLOPs utilization: peak bf16 throughput per device and the MFU ratio."""

from __future__ import annotations

import functools

import torch

from kempnerforge.metrics.logging import get_logger

logger = get_logger(__name__)

# Dense (no structured sparsity) bf16 tensor-core peaks with fp32 accumulation, which is what
# PyTorch's bf16 matmuls use. Matched as substrings of the CUDA device name, first match wins,
# so the more specific names come before the families they belong to.
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 125e12),
    ("RTX 4090", 165e12),  # 330e12 is the fp16-accumulate figure, not reachable in bf16
    ("RTX 3090", 71e12),
)

# Unknown names fall back by compute capability only where one capability means one class of
# datacenter part; consumer capabilities (8.6, 8.9, ...) span a 5x range of peaks, so they
# get no MFU rather than a guess.
PEAK_BF16_FLOPS_BY_CAPABILITY: dict[tuple[int, int], float] = {
    (8, 0): 312e12,  # A100 class
    (9, 0): 989e12,  # H100 SXM class
}


def peak_flops_per_sec(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of one device, or None where no honest figure is known.

    None on CPU and on CUDA devices that are neither in the table nor of a datacenter compute
    capability; the tracker then omits MFU instead of reporting it against a made-up peak.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = torch.cuda.get_device_name(index)
    capability = torch.cuda.get_device_capability(index)
    return _peak_for(name, capability)


@functools.cache
def _peak_for(name: str, capability: tuple[int, int]) -> float | None:
    """Table lookup by name, then by capability; cached so each device warns at most once."""
    for key, peak in PEAK_BF16_FLOPS:
        if key.lower() in name.lower():
            return peak
    peak = PEAK_BF16_FLOPS_BY_CAPABILITY.get(capability)
    if peak is None:
        logger.warning(
            "no bf16 peak known for %r (compute capability %d.%d); MFU is not reported",
            name,
            *capability,
        )
    else:
        logger.warning(
            "no bf16 peak known for %r; assuming %.0f TFLOP/s from compute capability %d.%d",
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
