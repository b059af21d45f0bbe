"""Objective: the loss a step minimises over one micro-batch and the units it is normalised by.

A step body runs its family's forward (the per-token losses against the batch's labels,
model/heads) and hands them with the batch to the job's objective, which returns the
micro-batch's summed loss; the step divides the sums of every micro-batch and rank by the
step's count of the objective's units, so each unit weighs the same however micro-batches
and ranks split them (training/accumulate.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kempnerforge.config.job import JobConfig
from kempnerforge.config.registry import Registry
from kempnerforge.model.heads import IGNORE_INDEX, HeadLoss

Batch = dict[str, torch.Tensor]


def label_count(batch: Batch) -> int:
    """Supervised tokens of a batch (labels that are not IGNORE_INDEX), read on the host."""
    return int((batch["labels"] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class Objective:
    """One objective: registered under its train.loss_fn name in OBJECTIVES."""

    name: str
    loss: Callable[[HeadLoss, Batch], torch.Tensor]
    """A micro-batch's summed loss (0-d, differentiable) from the family forward's
    per-token losses (differentiable only with ``per_token_grad``) and the batch (on the
    device), which carries whatever else the objective reads beside input ids and labels."""
    count: Callable[[Batch], int] = label_count
    """The units the micro-batch's loss sums over, counted on the host before the forward:
    supervised tokens for a token objective."""
    per_token_grad: bool = False
    """Whether ``loss`` differentiates through head.token_losses (a per-sequence or
    per-token weighting of the losses) rather than using head.loss_sum alone: the step
    then computes them from whole logits, whatever train.loss_chunk_tokens says, since the
    chunked head keeps only the gradient of their plain sum."""
    logits_loss: bool = False
    """Whether session.loss_fn(logits, labels) computes this objective from whole logits (the
    token objective's, which a user may replace); other objectives get per-token losses."""
    section: str | None = None
    """The JobConfig section of an objective's own settings ("dpo"), if it has one."""
    configure: Callable[[Any], Objective] | None = None
    """With ``section``: the objective with that section's settings, which objective_of
    returns in its place."""
    metric_sums: Callable[[HeadLoss, Batch], torch.Tensor] | None = None
    """The objective's own metrics of a micro-batch as detached sums (1-d, float64): the
    step adds them up over its micro-batches (StepResult.objective_sums)."""
    metrics_row: Callable[[list[float]], dict[str, float]] | None = None
    """The metrics.jsonl keys and values of a step's metric_sums, summed over every
    data-parallel rank."""
    batch_keys: tuple[str, ...] = ()
    """Keys the objective reads from a batch besides input ids and labels, which a batch
    stream adds (a reference model's log-probabilities)."""


OBJECTIVES: Registry[Objective] = Registry("train.loss_fn")
"""Objectives by train.loss_fn name."""


def objective_of(config: JobConfig) -> Objective:
    """The job's objective (with its section's settings, if it has one); a ConfigError
    naming train.loss_fn lists the registered ones."""
    objective = OBJECTIVES.get(config.train.loss_fn)
    if objective.section is None or objective.configure is None:
        return objective
    return objective.configure(getattr(config, objective.section))


def objective_metrics_row(
    objective: Objective,
    sums: list[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    with_metrics: bool,
) -> dict[str, float] | None:
    """On log steps, the objective's own metrics over every data-parallel rank (one
    all-reduce of the step's summed metric sums over ``group``); None otherwise or without
    any. Takes the sums (``sums`` is left empty) either way."""
    taken = list(sums)
    sums.clear()
    if not with_metrics or objective.metrics_row is None or not taken:
        return None
    total = torch.stack(taken).sum(dim=0)
    if group is not None:
        dist.all_reduce(total, group=group)
    return objective.metrics_row(total.tolist())
