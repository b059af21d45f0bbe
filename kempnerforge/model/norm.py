"""RMSNorm: the scale-only normalization of the blocks, and its form over a whole attention
projection or each head (model.qk_norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square normalization with a learned per-channel gain and no bias.

    The statistics are computed in fp32 and the result is cast back to the input dtype, so a
    bf16 activation stream never squares and averages thousands of values in bf16.

    With ``zero_centered`` (model.zero_centered_norms) the weight holds the gain's offset
    from 1 and starts at 0: the gain applied is 1 + weight, added in fp32.
    """

    def __init__(self, dim: int, eps: float = 1e-5, *, zero_centered: bool = False) -> None:
        super().__init__()
        self.eps = eps
        """Added to the mean square before the reciprocal square root."""
        self.gain_offset = 1.0 if zero_centered else 0.0
        """Added to the weight to give the gain: 1 for a zero-centred weight, else 0."""
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - self.gain_offset))
        """Per-channel gain (or its offset from 1), initialized to a gain of 1."""

    def reset_parameters(self) -> None:
        """Set the gain back to 1 (also after materializing a meta-device model)."""
        nn.init.constant_(self.weight, 1.0 - self.gain_offset)

    def gain(self) -> torch.Tensor:
        """The per-channel gain in fp32: the weight, plus 1 when zero-centred."""
        weight = self.weight.float()
        return weight + self.gain_offset if self.gain_offset else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), self.gain(), self.eps)
        return out.to(x.dtype)


class HeadRMSNorm(RMSNorm):
    """RMSNorm of each attention head on its own (model.qk_norm = 'per_head'), over the
    last dim of (batch, seq, heads, head_dim): one gain shared by every head. Its own
    class so tensor parallelism knows its input holds the rank's heads along dim 2."""


class ProjectionRMSNorm(RMSNorm):
    """RMSNorm over a whole attention projection (all its heads as one vector per token),
    written out in elementary operations instead of the fused kernel.

    Under tensor parallelism each rank holds some heads of the projection, and the mean
    square must still span all of them: with the input and gain as DTensors split along
    the channels (distributed/tensor_parallel.py), the sum below is a partial sum that
    DTensor reduces over the ranks before the root, which a fused kernel would instead
    answer by gathering the whole projection. Without sharding it computes what RMSNorm
    computes, to rounding.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        # The sum over the whole width (x.shape is the global one for a DTensor).
        mean_square = xf.pow(2).sum(-1, keepdim=True) / x.shape[-1]
        out = xf * torch.rsqrt(mean_square + self.eps) * self.gain()
        return out.to(x.dtype)
