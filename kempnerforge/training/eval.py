"""evaluate: mean held-out loss and perplexity over a fixed set of eval batches."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kempnerforge.training.loss import IGNORE_INDEX, cross_entropy_sum

if TYPE_CHECKING:
    from kempnerforge.training.loop import TrainingSession

# exp() of a diverged loss overflows a float; report perplexity as inf past this.
_MAX_LOG_PPL = 700.0


@torch.no_grad()
def evaluate(session: TrainingSession) -> dict[str, float]:
    """Token-weighted mean cross-entropy over eval.steps held-out batches; {} without eval data.

    The same batches every time (no shuffling), in eval mode, restoring train mode after.
    Uses no random numbers, so evaluating never perturbs the training run.
    """
    cfg = session.config
    if session.data.eval_dataset is None:
        return {}
    batch_size = cfg.eval.batch_size or cfg.train.batch_size
    model, device = session.model, session.runtime.device
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    num_tokens = 0
    try:
        for cpu_batch in session.data.eval_batches(cfg.eval.steps, batch_size):
            batch = {k: v.to(device) for k, v in cpu_batch.items()}
            doc_ids = batch.get("doc_ids") if cfg.data.document_masking else None
            logits = model(batch["input_ids"], doc_ids=doc_ids)
            loss_sum += cross_entropy_sum(logits, batch["labels"]).double()
            num_tokens += int((cpu_batch["labels"] != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    loss = float(loss_sum) / max(num_tokens, 1)
    ppl = math.exp(loss) if loss < _MAX_LOG_PPL else math.inf
    return {"eval_loss": loss, "eval_ppl": ppl, "eval_tokens": float(num_tokens)}
