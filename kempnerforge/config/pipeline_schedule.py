"""What a pipeline schedule asks of [train]: the rules distributed.pp_schedule adds to
JobConfig.validate once pp > 1."""

from __future__ import annotations

from kempnerforge.config.distributed import ZERO_BUBBLE_SCHEDULES, DistributedConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError


def check_pipeline_schedule(
    distributed: DistributedConfig, train: TrainConfig, fsdp_ranks: int
) -> None:
    """Refuse what distributed.pp_schedule cannot run with [train] when FSDP wraps each
    stage over ``fsdp_ranks`` ranks (dp_replicate * dp_shard * cp: context-parallel peers
    shard the weights too); nothing to check without pipeline parallelism.

    DualPipeV needs a micro-batch per stage before it can run both directions of the V;
    the zero-bubble schedules split each backward into its input and weight parts, which
    a compiled block's single backward graph does not offer, and which leave the last
    stage's block gradients unset under FSDP in this PyTorch version (measured: the
    blocks of the last stage end the step with no gradient, with dp_shard = 2 and with
    cp = 2 alike).
    """
    if distributed.pp == 1:
        return
    schedule = distributed.pp_schedule
    if schedule in ZERO_BUBBLE_SCHEDULES and fsdp_ranks > 1:
        # TODO(torch): lift once split backward reduces every FSDP unit of the last stage.
        raise ConfigError(
            "distributed.pp_schedule",
            schedule,
            "'gpipe', '1f1b' or 'interleaved_1f1b' with data or context parallelism "
            f"(dp_replicate * dp_shard * cp = {fsdp_ranks})",
            "zero-bubble schedules lose the last stage's block gradients under FSDP, which "
            "shards the weights over the data and context-parallel ranks, in this PyTorch "
            "version; use them with dp_replicate = dp_shard = cp = 1",
        )
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
