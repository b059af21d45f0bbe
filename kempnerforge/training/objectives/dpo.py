"""Direct preference optimisation (train.loss_fn = "dpo", settings in [dpo]): the loss over a
micro-batch of preference pairs, its units (pairs) and TRL's reward metrics.

A micro-batch holds B pairs as 2B rows: rows [0, B) the chosen responses, rows [B, 2B) the
rejected ones, pair i in rows i and B + i (TRL's layout). A row's log-probability is minus
the sum of its per-token losses over its response tokens (the labels that are not
IGNORE_INDEX); ``batch["ref_logps"]`` holds the reference model's, one per row, which the
reference's batch stream adds (training/objectives/reference.py).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kempnerforge.config.dpo import DPOConfig
from kempnerforge.model.heads import IGNORE_INDEX, HeadLoss
from kempnerforge.training.objectives.objective import OBJECTIVES, Batch, Objective

REF_LOGPS = "ref_logps"
"""Batch key: the reference model's log-probability of each row's response, (2B,) fp32."""

METRIC_KEYS = (
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)
"""Metrics (TRL's names), each a mean over the step's pairs: beta times the policy's minus the
reference's log-probability of the chosen and of the rejected response, the share of pairs
whose chosen reward is the larger, their difference, and the policy's log-probabilities
(SimPO's, as TRL's CPO logs them: the mean log-probabilities per token, times beta)."""


def pair_count(batch: Batch) -> int:
    """Pairs of a micro-batch: half its rows."""
    return batch["labels"].shape[0] // 2


def response_logps(token_losses: torch.Tensor) -> torch.Tensor:
    """Each row's log-probability of its response: minus its summed per-token losses (those
    of ignored labels are 0)."""
    return -token_losses.float().sum(dim=1)


def response_tokens(batch: Batch) -> torch.Tensor:
    """Each row's response tokens (its labels that are not IGNORE_INDEX), at least 1."""
    return (batch["labels"] != IGNORE_INDEX).sum(dim=1).clamp(min=1)


def _log_ratios(cfg: DPOConfig, head: HeadLoss, batch: Batch) -> tuple[torch.Tensor, ...]:
    """(policy logps, chosen log-ratios, rejected log-ratios): the log-ratios are the
    policy's minus the reference's log-probabilities, per pair. SimPO has no reference: its
    logps and "ratios" are each response's mean log-probability per token (TRL's CPO)."""
    logps = response_logps(head.token_losses)
    if cfg.loss_type == "simpo":
        logps = logps / response_tokens(batch).to(logps.dtype)
        chosen, rejected = logps.chunk(2)
        return logps, chosen, rejected
    ratios = logps - batch[REF_LOGPS].to(logps.dtype)
    chosen, rejected = ratios.chunk(2)
    return logps, chosen, rejected


def pair_losses(cfg: DPOConfig, head: HeadLoss, batch: Batch) -> torch.Tensor:
    """Each pair's loss, (B,), as cfg.loss_type defines it."""
    _, chosen, rejected = _log_ratios(cfg, head, batch)
    beta, smoothing = cfg.beta, cfg.label_smoothing
    if cfg.loss_type == "ipo":
        # IPO on log-ratios per response token (TRL's normalisation), towards 1 / (2 beta).
        chosen_tokens, rejected_tokens = response_tokens(batch).to(chosen.dtype).chunk(2)
        delta = chosen / chosen_tokens - rejected / rejected_tokens
        return (delta - 1 / (2 * beta)) ** 2
    logits = beta * (chosen - rejected)
    if cfg.loss_type == "simpo":  # a target margin of gamma between the mean log-probs
        logits = logits - cfg.simpo_gamma
    if cfg.loss_type == "hinge":
        return torch.relu(1 - logits)
    clean = -F.logsigmoid(logits)
    flipped = -F.logsigmoid(-logits)
    if cfg.loss_type == "robust":  # rDPO: unbiased under a flip rate of label_smoothing
        return ((1 - smoothing) * clean - smoothing * flipped) / (1 - 2 * smoothing)
    return (1 - smoothing) * clean + smoothing * flipped  # sigmoid, simpo; smoothed: cDPO


def dpo_loss(cfg: DPOConfig, head: HeadLoss, batch: Batch) -> torch.Tensor:
    """The micro-batch's summed pair losses (the step divides by its pairs)."""
    return pair_losses(cfg, head, batch).sum()


def dpo_metric_sums(cfg: DPOConfig, head: HeadLoss, batch: Batch) -> torch.Tensor:
    """The micro-batch's sums of METRIC_KEYS' terms and its pairs, detached, in float64."""
    with torch.no_grad():
        logps, chosen, rejected = _log_ratios(cfg, head, batch)
        chosen_rewards, rejected_rewards = cfg.beta * chosen, cfg.beta * rejected
        chosen_logps, rejected_logps = logps.chunk(2)
        terms = (
            chosen_rewards,
            rejected_rewards,
            (chosen_rewards > rejected_rewards).float(),
            chosen_rewards - rejected_rewards,
            chosen_logps,
            rejected_logps,
        )
        pairs = torch.tensor(float(chosen.numel()), device=chosen.device)
        return torch.stack([*(t.double().sum() for t in terms), pairs.double()])


def dpo_metrics_row(sums: list[float]) -> dict[str, float]:
    """Means over the step's pairs (the last sum) of its summed METRIC_KEYS terms."""
    *terms, pairs = sums
    return {key: value / max(pairs, 1.0) for key, value in zip(METRIC_KEYS, terms, strict=True)}


def configure_dpo(cfg: DPOConfig) -> Objective:
    """The DPO objective with the job's [dpo] settings."""
    return Objective(
        "dpo",
        loss=functools.partial(dpo_loss, cfg),
        count=pair_count,
        per_token_grad=True,
        metric_sums=functools.partial(dpo_metric_sums, cfg),
        metrics_row=dpo_metrics_row,
        batch_keys=() if cfg.loss_type == "simpo" else (REF_LOGPS,),
    )


DPO = OBJECTIVES.register("dpo")(
    Objective("dpo", loss=functools.partial(dpo_loss, DPOConfig()), count=pair_count,
              per_token_grad=True, section="dpo", configure=configure_dpo)
)  # fmt: skip
