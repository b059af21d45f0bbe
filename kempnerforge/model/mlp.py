"""SwiGLU feed-forward sublayer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """Gated feed-forward: w2(silu(w1(x)) * w3(x)), all projections bias-free."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        """Gate projection (passed through SiLU)."""
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        """Up projection (multiplied by the gate)."""
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        """Down projection back into the residual stream; its init is depth-scaled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
