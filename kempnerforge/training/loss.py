"""build_loss_fn: token cross-entropy with ignore_index and an optional output z-loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kempnerforge.config.train import TrainConfig
from kempnerforge.data.dataset import IGNORE_INDEX

__all__ = ["IGNORE_INDEX", "LossFn", "build_loss_fn", "cross_entropy_sum", "token_losses"]

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


def _z_terms(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logsumexp(logits)^2 per position, zero where the label is ignored."""
    log_z = torch.logsumexp(logits.float(), dim=-1)
    return log_z.square() * (labels != IGNORE_INDEX)


def token_losses(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0
) -> torch.Tensor:
    """The training objective per position, shaped like ``labels`` (0 where ignored).

    Cross-entropy plus ``z_loss_weight`` times the z-loss term: summed, it is what
    ``build_loss_fn`` returns for the same weight, so per-source sums of these add up to
    the step's loss.
    """
    per_token = F.cross_entropy(
        logits.flatten(0, -2).float(),
        labels.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    ).view(labels.shape)
    if z_loss_weight:
        per_token = per_token + z_loss_weight * _z_terms(logits, labels)
    return per_token


def build_loss_fn(cfg: TrainConfig) -> LossFn:
    """The summed training loss for cfg.loss_fn, with the z-loss term when z_loss_weight > 0.

    z-loss adds weight * logsumexp(logits)^2 per supervised token, keeping the softmax
    normaliser near 1 (PaLM); it is summed like the cross-entropy.
    """
    if cfg.z_loss_weight == 0:
        return cross_entropy_sum
    weight = cfg.z_loss_weight

    def cross_entropy_with_z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return cross_entropy_sum(logits, labels) + weight * _z_terms(logits, labels).sum()

    return cross_entropy_with_z_loss
