"""build_loss_fn: token cross-entropy with ignore_index and an optional output z-loss."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kempnerforge.config.train import TrainConfig

IGNORE_INDEX = -100
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


def build_loss_fn(cfg: TrainConfig) -> LossFn:
    """The summed training loss for cfg.loss_fn, with the z-loss term when z_loss_weight > 0.

    z-loss adds weight * logsumexp(logits)^2 per supervised token, keeping the softmax
    normaliser near 1 (PaLM); it is summed like the cross-entropy.
    """
    if cfg.z_loss_weight == 0:
        return cross_entropy_sum
    weight = cfg.z_loss_weight

    def cross_entropy_with_z_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        mask = labels.flatten() != IGNORE_INDEX
        log_z = torch.logsumexp(logits.flatten(0, -2).float(), dim=-1)
        return cross_entropy_sum(logits, labels) + weight * (log_z.square() * mask).sum()

    return cross_entropy_with_z_loss
