"""The model families' forwards outside the training step: the summed loss of one batch for
eval, the logits of a token window for the end-of-run sample, and the training's autocast.

Each family names its own (ModelFamily.batch_loss and .sample, training/families/), so
eval and sampling of a vision-language model run its own forward (images and text)
instead of a text-only call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from kempnerforge.config.train import TrainConfig
from kempnerforge.model.attention import needs_document_mask
from kempnerforge.model.heads import HeadLossSpec
from kempnerforge.training.loss import cross_entropy_sum

BatchLoss = Callable[
    [torch.nn.Module, dict[str, torch.Tensor], dict[str, torch.Tensor], HeadLossSpec],
    torch.Tensor,
]
"""(model, batch on the device, the same batch on the host, spec) -> summed loss, 0-d."""


def text_batch_loss_fn(document_masking: bool) -> BatchLoss:
    """A text model's summed cross-entropy of one batch: the chunked head when
    spec.chunk_tokens > 0, else whole logits; document ids only when a row packs several
    documents (read from the host copy, no device sync)."""

    def batch_loss(
        model: torch.nn.Module,
        batch: dict[str, torch.Tensor],
        cpu_batch: dict[str, torch.Tensor],
        spec: HeadLossSpec,
    ) -> torch.Tensor:
        masked = document_masking and needs_document_mask(cpu_batch.get("doc_ids"))
        doc_ids = batch.get("doc_ids") if masked else None
        if spec.chunk_tokens > 0:
            labels = batch["labels"]
            return model(
                batch["input_ids"], doc_ids=doc_ids, labels=labels, loss_spec=spec
            ).loss_sum
        return cross_entropy_sum(model(batch["input_ids"], doc_ids=doc_ids), batch["labels"])

    return batch_loss


def vlm_batch_loss(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    cpu_batch: dict[str, torch.Tensor],
    spec: HeadLossSpec,
) -> torch.Tensor:
    """A vision-language model's summed cross-entropy over the text positions of a batch."""
    del cpu_batch
    pixels, input_ids, labels = batch["pixel_values"], batch["input_ids"], batch["labels"]
    if spec.chunk_tokens > 0:
        return model(pixels, input_ids, labels=labels, loss_spec=spec).loss_sum
    return cross_entropy_sum(model(pixels, input_ids), labels)


WindowLogits = Callable[[torch.Tensor], torch.Tensor]
"""token ids (1, seq) -> logits (1, seq, vocab)."""


def vlm_window_logits(model: torch.nn.Module, pixel_values: torch.Tensor) -> WindowLogits:
    """Logits of a caption window conditioned on one image (1, 3, H, W)."""
    return lambda ids: model(pixel_values, ids)


def training_autocast(
    train: TrainConfig, device: torch.device
) -> contextlib.AbstractContextManager:
    """The autocast a training step's forward runs under (training/accumulate.py): bf16
    when train.mixed_precision resolves to bf16 on ``device``, none otherwise. A forward
    outside the step (eval) runs under it too, so it computes in the training's precision
    in every layout, not only where FSDP gathers bf16 parameters."""
    if train.precision_on(device.type) == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
