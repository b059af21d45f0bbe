"""The token embedding: token ids to residual-stream vectors, times model.embedding_multiplier."""

from __future__ import annotations

import torch
from torch import nn


class TokenEmbedding(nn.Embedding):
    """The token embedding, its output times a multiplier (model.embedding_multiplier).

    The multiplier is rounded to the output's dtype before the product, as Gemma's
    reference computes it (sqrt(3072) = 55.43 is 55.5 in bf16). A plain Python number
    times the output keeps every layout's form of the output (a DTensor under tensor
    parallelism) as it is. A multiplier of 1 costs nothing."""

    def __init__(self, num_embeddings: int, embedding_dim: int, multiplier: float = 1.0) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.multiplier = multiplier
        """model.embedding_multiplier."""
        self._rounded = {
            dtype: float(torch.tensor(multiplier, dtype=dtype, device="cpu"))
            for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        }

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = super().forward(input)
        if self.multiplier == 1.0:
            return out
        return out * self._rounded.get(out.dtype, self.multiplier)
