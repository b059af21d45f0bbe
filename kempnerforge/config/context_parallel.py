"""The rules distributed.cp (context parallelism) sets on the rest of a job's config.

Checked in JobConfig.validate, on every rank before any collective, so a layout that
context parallelism cannot run stops with one ConfigError everywhere.
"""

from __future__ import annotations

from kempnerforge.config.distributed import DistributedConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError

_FIELD = "distributed.cp"


def check_context_parallel(
    dist: DistributedConfig, model: ModelConfig, train: TrainConfig, is_vlm: bool
) -> None:
    """Refuse a cp the sequence or the heads cannot split, and a vision-language model,
    which does not run under context parallelism.

    Each cp rank holds seq_len / cp positions of every sequence; attention exchanges them
    for n_heads / cp query heads and kv_heads / cp key/value heads of the whole sequence
    (all-to-all), so both head counts must divide by cp, and by tp * cp where tensor
    parallelism splits them first.
    """
    cp = dist.cp
    if cp == 1:
        return
    if train.seq_len % cp:
        raise ConfigError(
            _FIELD,
            cp,
            f"a divisor of train.seq_len = {train.seq_len}",
            "each context-parallel rank holds an equal slice of every sequence",
        )
    for name, heads in (("n_heads", model.n_heads), ("n_kv_heads", model.kv_heads)):
        # Tensor parallelism has split the heads first (JobConfig checked tp divides them).
        local = heads // dist.tp
        if local % cp:
            where = f"model.{name} = {heads}"
            if dist.tp > 1:
                where = f"model.{name} / distributed.tp = {heads} / {dist.tp} = {local}"
            raise ConfigError(
                _FIELD,
                cp,
                f"a divisor of {where}",
                "attention gives each context-parallel rank whole heads of the full "
                "sequence, so cp can be at most the key/value heads",
            )
    if is_vlm:
        raise ConfigError(
            _FIELD,
            cp,
            "1 with a vision-language model ([vlm])",
            "context parallelism runs with data, tensor, pipeline and expert parallelism, "
            "compiled blocks and MoE models; set distributed.cp = 1 or leave [vlm] out",
        )
