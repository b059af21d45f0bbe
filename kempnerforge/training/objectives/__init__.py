"""Training objectives: what a step minimises over its micro-batches and what it counts them
by, one value per objective, chosen by train.loss_fn. The step bodies read the objective
through this seam, so a new objective (a preference loss, a policy-gradient loss) is a new
file registered here, not a branch in a step body. mtp.py adds a model's multi-token-
prediction term (model.mtp_depth) to whichever objective the job trains."""

from __future__ import annotations

from kempnerforge.training.objectives import cross_entropy as _cross_entropy  # registers it
from kempnerforge.training.objectives.mtp import (
    MTP_LOSS,
    MTP_LOSS_BY_DEPTH,
    add_mtp_loss,
    begin_mtp_step,
    finish_mtp_step,
    mtp_forward_args,
)
from kempnerforge.training.objectives.objective import (
    OBJECTIVES,
    Batch,
    Objective,
    label_count,
    objective_of,
)

__all__ = [
    "MTP_LOSS",
    "MTP_LOSS_BY_DEPTH",
    "OBJECTIVES",
    "Batch",
    "Objective",
    "add_mtp_loss",
    "begin_mtp_step",
    "finish_mtp_step",
    "label_count",
    "mtp_forward_args",
    "objective_of",
]
del _cross_entropy
