"""Training objectives: what a step minimises over its micro-batches and what it counts them
by, one value per objective, chosen by train.loss_fn. The step bodies read the objective
through this seam, so a new objective (a preference loss, a policy-gradient loss) is a new
file registered here, not a branch in a step body. mtp.py adds a model's multi-token-
prediction term (model.mtp_depth) to whichever objective the job trains; dpo.py is direct
preference optimisation ([dpo]), reference.py its frozen reference model; grpo.py is group
relative policy optimisation ([grpo]), rollouts.py the completions the policy samples for it
and rewards.py what scores them."""

from __future__ import annotations

from kempnerforge.training.objectives import cross_entropy as _cross_entropy  # registers it
from kempnerforge.training.objectives import dpo as _dpo  # registers it
from kempnerforge.training.objectives import grpo as _grpo  # registers it
from kempnerforge.training.objectives.dpo import METRIC_KEYS as DPO_METRIC_KEYS
from kempnerforge.training.objectives.dpo import REF_LOGPS, response_logps
from kempnerforge.training.objectives.grpo import METRIC_KEYS as GRPO_METRIC_KEYS
from kempnerforge.training.objectives.grpo import OLD_LOGPS
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
    objective_metrics_row,
    objective_of,
)
from kempnerforge.training.objectives.reference import (
    ReferenceLogps,
    freeze_reference,
    load_reference_weights,
    reference_logps,
)
from kempnerforge.training.objectives.rewards import (
    REWARDS,
    RewardFn,
    checked_reward,
    exact_answer,
    load_reward,
)
from kempnerforge.training.objectives.rollouts import Rollouts
from kempnerforge.training.objectives.sampling import Decoding
from kempnerforge.training.objectives.stored_reference import (
    StoredReference,
    attach_stored_reference,
    preference_reference,
    reference_source,
)

__all__ = [
    "DPO_METRIC_KEYS",
    "Decoding",
    "GRPO_METRIC_KEYS",
    "OLD_LOGPS",
    "Rollouts",
    "MTP_LOSS",
    "MTP_LOSS_BY_DEPTH",
    "OBJECTIVES",
    "REF_LOGPS",
    "REWARDS",
    "RewardFn",
    "ReferenceLogps",
    "StoredReference",
    "attach_stored_reference",
    "load_reference_weights",
    "preference_reference",
    "reference_source",
    "Batch",
    "Objective",
    "add_mtp_loss",
    "freeze_reference",
    "begin_mtp_step",
    "checked_reward",
    "exact_answer",
    "finish_mtp_step",
    "label_count",
    "load_reward",
    "mtp_forward_args",
    "objective_metrics_row",
    "objective_of",
    "reference_logps",
    "response_logps",
]
del _cross_entropy, _dpo, _grpo
