"""RMSNorm: the scale-only normalization used before every sublayer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned per-channel gain and no bias.

    The statistics are computed in fp32 and the result is cast back to the input dtype, so a
    bf16 activation stream never squares and averages thousands of values in bf16.
    """

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        """Added to the mean square before the reciprocal square root."""
        self.weight = nn.Parameter(torch.ones(dim))
        """Per-channel gain, initialized to 1."""

    def reset_parameters(self) -> None:
        """Set the gain back to 1 (also after materializing a meta-device model)."""
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.to(x.dtype)
