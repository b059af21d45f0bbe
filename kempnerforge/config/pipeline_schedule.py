"""What a pipeline schedule asks of [train]: the rules distributed.pp_schedule adds to
JobConfig.validate once pp > 1."""

from __future__ import annotations

from kempnerforge.config.distributed import ZERO_BUBBLE_SCHEDULES, DistributedConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError


def check_pipeline_schedule(distributed: DistributedConfig, train: TrainConfig) -> None:
    """Refuse a [train] section distributed.pp_schedule cannot run (pp > 1 assumed).

    DualPipeV needs a micro-batch per stage before it can run both directions of the V,
    and the zero-bubble schedules split each backward into its input and weight parts,
    which a compiled block's single backward graph does not offer.
    """
    schedule = distributed.pp_schedule
    stages = distributed.num_stages
    if schedule == "dualpipev" and train.grad_accum_steps < stages:
        raise ConfigError(
            "train.grad_accum_steps",
            train.grad_accum_steps,
            f"at least the {stages} pipeline stages (2 * distributed.pp) with "
            "pp_schedule = 'dualpipev'",
            "DualPipeV feeds micro-batches into both ends of the V at once",
        )
    if schedule in ZERO_BUBBLE_SCHEDULES and train.compile:
        raise ConfigError(
            "train.compile",
            True,
            f"false with distributed.pp_schedule = {schedule!r}",
            "zero-bubble schedules split each backward into input and weight gradients, "
            "which compiled blocks do not support; use pp_schedule = '1f1b' or "
            "'interleaved_1f1b' to compile",
        )
