"""The token objective: cross-entropy (and the optional z-loss) summed over supervised tokens,
pretraining's and supervised fine-tuning's loss."""

from __future__ import annotations

import torch

from kempnerforge.model.heads import HeadLoss
from kempnerforge.training.objectives.objective import OBJECTIVES, Batch, Objective


def token_loss(head: HeadLoss, batch: Batch) -> torch.Tensor:
    """The head's own summed loss: every supervised token once."""
    return head.loss_sum


CROSS_ENTROPY = OBJECTIVES.register("cross_entropy")(
    Objective("cross_entropy", loss=token_loss, logits_loss=True)
)
