"""build_loss_fn: token cross-entropy with ignore_index and an optional output z-loss.

token_losses (the same objective per position) lives beside the fused output head in
model/heads/head_loss.py, which computes it without whole logits; it is re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kempnerforge.config.train import TrainConfig
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.model.heads import token_losses, z_loss_terms

__all__ = [
    "IGNORE_INDEX",
    "LossFn",
    "TokenCrossEntropy",
    "build_loss_fn",
    "cross_entropy_sum",
    "token_losses",
]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) token cross-entropy over labels != IGNORE_INDEX.

    The loss functions return sums so the step can divide by the number of supervised tokens
    in the whole step (all micro-batches), which weights every token equally.
    """
    return F.cross_entropy(
        logits.flatten(0, -2).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


@dataclass(frozen=True)
class TokenCrossEntropy:
    """The built-in training loss: summed token cross-entropy, plus ``z_loss_weight`` times
    logsumexp(logits)^2 per supervised token (PaLM's z-loss, keeping the softmax
    normaliser near 1), summed like the cross-entropy.

    A class rather than a bare function so a step body can tell it apart from a loss put
    in its place (session.loss_fn is replaceable): only this objective may be computed
    inside the model by the fused output head (train.loss_chunk_tokens), which then never
    calls it; any other loss function gets the logits.
    """

    z_loss_weight: float = 0.0

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.z_loss_weight == 0:
            return cross_entropy_sum(logits, labels)
        logits = logits.float()  # one fp32 copy serves both terms
        z_terms = z_loss_terms(logits, labels).sum()
        return cross_entropy_sum(logits, labels) + self.z_loss_weight * z_terms


def build_loss_fn(cfg: TrainConfig) -> LossFn:
    """The summed training loss for cfg.loss_fn, with the z-loss term when z_loss_weight > 0."""
    return TokenCrossEntropy(cfg.z_loss_weight)
