"""evaluate: mean held-out loss and perplexity over a fixed set of eval batches per set."""

from __future__ import annotations

import math

import torch

from kempnerforge.config.job import JobConfig
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.training.loss import cross_entropy_sum
from kempnerforge.training.session import TrainingSession

# exp() of a diverged loss overflows a float; report perplexity as inf past this.
_MAX_LOG_PPL = 700.0


def perplexity(loss: float) -> float:
    """exp(loss), or inf once that would overflow."""
    return math.exp(loss) if loss < _MAX_LOG_PPL else math.inf


def evaluate(session: TrainingSession) -> dict[str, float]:
    """Token-weighted mean cross-entropy over eval.steps held-out batches per set.

    See evaluate_model; this is it for the session's model, data and device.
    """
    return evaluate_model(session.model, session.data, session.config, session.runtime.device)


@torch.no_grad()
def evaluate_model(
    model: torch.nn.Module, data: DataPipeline, config: JobConfig, device: torch.device
) -> dict[str, float]:
    """``eval_loss``, ``eval_ppl`` and ``eval_tokens`` over every eval set; {} without eval data.

    The overall loss is token-weighted over all sets. With ``[[eval.sets]]`` configured there
    are also ``eval_loss/<name>``, ``eval_ppl/<name>`` and ``eval_tokens/<name>`` per set.
    The same batches every time (no shuffling), in eval mode, restoring train mode after.
    Uses no random numbers, so evaluating never perturbs the training run.
    """
    names = [s.name for s in config.eval.sets]
    if names and list(data.eval_datasets) != names:
        raise RuntimeError(
            f"eval.sets names {names} but the data pipeline holds {list(data.eval_datasets)}: "
            "build it with build_data_pipeline(..., eval_sets=config.eval.sets)"
        )
    if not data.eval_datasets:
        return {}
    batch_size = config.eval.batch_size or config.train.batch_size
    was_training = model.training
    model.eval()
    per_set: dict[str, float] = {}
    total_loss, total_tokens = 0.0, 0
    try:
        for name in data.eval_datasets:
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            num_tokens = 0
            for cpu_batch in data.eval_batches(config.eval.steps, batch_size, name):
                batch = {k: v.to(device) for k, v in cpu_batch.items()}
                doc_ids = batch.get("doc_ids") if config.data.document_masking else None
                logits = model(batch["input_ids"], doc_ids=doc_ids)
                loss_sum += cross_entropy_sum(logits, batch["labels"]).double()
                num_tokens += int((cpu_batch["labels"] != IGNORE_INDEX).sum())
            set_loss_sum = float(loss_sum)
            total_loss += set_loss_sum
            total_tokens += num_tokens
            loss = set_loss_sum / max(num_tokens, 1)
            per_set[f"eval_loss/{name}"] = loss
            per_set[f"eval_ppl/{name}"] = perplexity(loss)
            per_set[f"eval_tokens/{name}"] = num_tokens
    finally:
        model.train(was_training)
    loss = total_loss / max(total_tokens, 1)
    metrics = {"eval_loss": loss, "eval_ppl": perplexity(loss), "eval_tokens": total_tokens}
    if config.eval.sets:
        metrics.update(per_set)
    return metrics
