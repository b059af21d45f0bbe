"""The gated feed-forward sublayer: SwiGLU, or GeGLU (model.ffn_activation)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Gemma's gelu_pytorch_tanh)."""
    return F.gelu(x, approximate="tanh")


GATE_ACTIVATIONS = {"silu": F.silu, "gelu_tanh": gelu_tanh}
"""The gate's nonlinearity by model.ffn_activation."""


class SwiGLU(nn.Module):
    """Gated feed-forward: w2(act(w1(x)) * w3(x)), all projections bias-free; act is SiLU
    (SwiGLU) unless ``activation`` names another (model.ffn_activation: 'gelu_tanh' makes
    it Gemma's GeGLU). The class keeps its name: the projections and their roles, and so
    every tensor name and parallel plan, are the same."""

    def __init__(self, dim: int, hidden_dim: int, activation: str = "silu") -> None:
        super().__init__()
        self.activation = GATE_ACTIVATIONS[activation]
        """The gate's nonlinearity."""
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        """Gate projection (passed through SiLU)."""
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        """Up projection (multiplied by the gate)."""
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        """Down projection back into the residual stream; its init is depth-scaled."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))
