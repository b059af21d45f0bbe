"""Group relative policy optimisation (train.loss_fn = "grpo", settings in [grpo]): the clipped
policy-gradient loss over a micro-batch of sampled completions, its units (completion tokens)
and the metrics GRPO users read.

A row of a rollout micro-batch is one prompt and one completion the policy sampled for it
(training/objectives/rollouts.py): its labels are the completion's tokens (IGNORE_INDEX
elsewhere), ``old_logps`` the sampling policy's log-probability of each label (0 where
ignored), ``advantages`` the completion's reward against its group's, ``rewards`` the reward
itself, and with grpo.kl_beta > 0 ``ref_token_logps`` a frozen reference's log-probabilities.

Per completion token t with log-probability logp_t under the policy being trained:
ratio_t = exp(logp_t - old_t), and its loss is -min(ratio_t A, clip(ratio_t, 1 - clip_low,
1 + clip_high) A) + kl_beta k3_t, with k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1.
The step sums these over every completion token of its micro-batches and ranks and divides
by their number (the objective's count), so each token weighs the same (TRL's "dapo"
normalisation, DAPO's token-level loss): a long completion is not down-weighted per token.
"""

from __future__ import annotations

import functools

import torch

from kempnerforge.config.grpo import GRPOConfig
from kempnerforge.model.heads import IGNORE_INDEX, HeadLoss
from kempnerforge.training.objectives.objective import OBJECTIVES, Batch, Objective, label_count

OLD_LOGPS = "old_logps"
"""Batch key: the sampling policy's log-probability of each label, (rows, seq) fp32, 0 where
the label is IGNORE_INDEX."""
ADVANTAGES = "advantages"
"""Batch key: each row's advantage, (rows,) fp32."""
REWARDS = "rewards"
"""Batch key: each row's reward, (rows,) fp32 (for the metrics)."""
REF_TOKEN_LOGPS = "ref_token_logps"
"""Batch key (grpo.kl_beta > 0): the reference's log-probability of each label, as OLD_LOGPS."""

METRIC_KEYS = (
    "grpo/reward",
    "grpo/reward_std",
    "grpo/completion_tokens",
    "grpo/clip_ratio",
    "grpo/kl",
)
"""Metrics of a step's completions: their mean reward and its standard deviation over the
step's rows, their mean length in tokens, the share of completion tokens whose ratio the clip
bounded (below 1 - clip_low with a negative advantage, above 1 + clip_high with a positive
one), and the mean per-token KL estimate k3 to the reference (0 without one)."""


def token_terms(cfg: GRPOConfig, head: HeadLoss, batch: Batch) -> dict[str, torch.Tensor]:
    """Per-token pieces of the loss, each (rows, seq) fp32 and 0 where the label is ignored:
    the loss itself, the ratio, whether the clip bounded it, and k3."""
    mask = (batch["labels"] != IGNORE_INDEX).float()
    logps = -head.token_losses.float()
    # Ignored positions hold 0 on both sides: their ratio is exp(0) = 1, never inf.
    log_ratio = (logps - batch[OLD_LOGPS].float()) * mask
    ratio = torch.exp(log_ratio)
    advantages = batch[ADVANTAGES].float().unsqueeze(1)
    low, high = 1 - cfg.clip_low, 1 + cfg.clip_high
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages)
    loss = -surrogate
    kl = torch.zeros_like(loss)
    if cfg.kl_beta > 0:
        gap = (batch[REF_TOKEN_LOGPS].float() - logps) * mask
        kl = torch.exp(gap) - gap - 1
        loss = loss + cfg.kl_beta * kl
    clipped = ((ratio < low) & (advantages < 0)) | ((ratio > high) & (advantages > 0))
    return {"loss": loss * mask, "ratio": ratio, "clipped": clipped.float() * mask, "kl": kl * mask}


def grpo_loss(cfg: GRPOConfig, head: HeadLoss, batch: Batch) -> torch.Tensor:
    """The micro-batch's summed per-token losses (the step divides by its completion
    tokens)."""
    return token_terms(cfg, head, batch)["loss"].sum()


def grpo_metric_sums(cfg: GRPOConfig, head: HeadLoss, batch: Batch) -> torch.Tensor:
    """The micro-batch's sums behind METRIC_KEYS, detached, float64: rewards, squared
    rewards, rows, completion tokens, clipped tokens, k3."""
    with torch.no_grad():
        terms = token_terms(cfg, head, batch)
        rewards = batch[REWARDS].double()
        tokens = (batch["labels"] != IGNORE_INDEX).sum()
        return torch.stack(
            [
                rewards.sum(),
                (rewards**2).sum(),
                torch.tensor(float(rewards.numel()), dtype=torch.float64, device=rewards.device),
                tokens.double(),
                terms["clipped"].double().sum(),
                terms["kl"].double().sum(),
            ]
        )


def grpo_metrics_row(sums: list[float]) -> dict[str, float]:
    """METRIC_KEYS from a step's sums over every data-parallel rank."""
    reward, reward_sq, rows, tokens, clipped, kl = sums
    rows, per_token = max(rows, 1.0), max(tokens, 1.0)
    mean = reward / rows
    variance = max(reward_sq / rows - mean * mean, 0.0)
    values = (mean, variance**0.5, tokens / rows, clipped / per_token, kl / per_token)
    return dict(zip(METRIC_KEYS, values, strict=True))


def batch_keys(cfg: GRPOConfig) -> tuple[str, ...]:
    """What a rollout micro-batch carries for this objective besides input ids and labels."""
    keys = (OLD_LOGPS, ADVANTAGES, REWARDS)
    return (*keys, REF_TOKEN_LOGPS) if cfg.kl_beta > 0 else keys


def configure_grpo(cfg: GRPOConfig) -> Objective:
    """The GRPO objective with the job's [grpo] settings."""
    return Objective(
        "grpo",
        loss=functools.partial(grpo_loss, cfg),
        count=label_count,
        per_token_grad=True,
        metric_sums=functools.partial(grpo_metric_sums, cfg),
        metrics_row=grpo_metrics_row,
        batch_keys=batch_keys(cfg),
    )


GRPO = OBJECTIVES.register("grpo")(
    Objective("grpo", loss=functools.partial(grpo_loss, GRPOConfig()), count=label_count,
              per_token_grad=True, section="grpo", configure=configure_grpo,
              batch_keys=batch_keys(GRPOConfig()))
)  # fmt: skip
