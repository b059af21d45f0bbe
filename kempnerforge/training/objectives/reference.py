"""The reference model of a preference objective (dpo.reference = "live"): a frozen copy of
the policy's starting weights, built and sharded as the policy is, whose log-probability of
each row's response the batch stream adds to every micro-batch before the step reads it.

Its cost: one more copy of the weights (no gradients, no optimizer state) and one more
forward per micro-batch, without a backward: about a third more compute per step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.core.logging import get_logger
from kempnerforge.model.heads import logits_head_loss
from kempnerforge.training.objectives.dpo import REF_LOGPS, response_logps
from kempnerforge.training.objectives.objective import Batch

logger = get_logger(__name__)


@torch.no_grad()
def reference_logps(
    reference: nn.Module,
    batch: Batch,
    device: torch.device,
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> torch.Tensor:
    """Each row's log-probability of its response under ``reference``, (rows,) fp32 on
    ``device``: the same forward (under ``autocast``, the training's) and per-token losses
    as the policy's, without a graph. A preference row is one sequence: no document mask."""
    inputs = batch["input_ids"].to(device)
    labels = batch["labels"].to(device)
    with autocast():
        logits = reference(inputs)
    return response_logps(logits_head_loss(logits, labels, 0.0).token_losses)


def freeze_reference(model: nn.Module) -> nn.Module:
    """Make ``model`` a reference: eval mode (no dropout), no parameter asks for a gradient."""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


class ReferenceLogps:
    """Adds each row's reference log-probability (batch[REF_LOGPS], on the device) to a
    micro-batch: the batch stream's ``add_keys`` (training/session.py BatchStream). Every
    rank of a tensor-parallel or FSDP group runs the reference's forward on its own
    micro-batch, in step with its peers, as the policy does."""

    def __init__(
        self,
        reference: nn.Module,
        device: torch.device,
        autocast: Callable[[], contextlib.AbstractContextManager],
    ) -> None:
        self.reference = reference
        self._device = device
        self._autocast = autocast

    def __call__(self, batch: Batch) -> Batch:
        if REF_LOGPS in batch:  # a replayed micro-batch keeps its reference log-probabilities
            return batch
        batch[REF_LOGPS] = reference_logps(self.reference, batch, self._device, self._autocast)
        return batch


def load_reference_weights(
    reference: torch.nn.Module, checkpointer: CheckpointManager, cfg: CheckpointConfig
) -> None:
    """Give a preference objective's reference (built as the policy is, from the seed) the
    weights of the checkpoint checkpoint.resume_from names, or keep the seed's when it names
    none ('auto' or 'none': a run that resumes its own checkpoints keeps the reference its
    first launch had). Collective (the checkpoint's verdict and load)."""
    if cfg.resume_from in ("auto", "none"):
        logger.info("reference weights from the seed's initialisation (train.seed)")
        return
    path = checkpointer.find_resume_path()
    assert path is not None, "an explicit checkpoint.resume_from resolves or raises"
    checkpointer.load_weights(path, model=reference)
    logger.info("reference weights from %s", checkpointer.location_of(path))
