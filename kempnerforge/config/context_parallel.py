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
    for n_heads / cp query heads of the whole sequence and their key/value heads
    (all-to-all), so cp must divide the query heads (per tp rank, where tensor parallelism
    splits them first), and divide the key/value heads or be a multiple of them: with
    fewer key/value heads than ranks, each is repeated to the ranks whose query heads read
    it (model/sequence_split.py).
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
    # Tensor parallelism has split the heads first (JobConfig checked tp divides them).
    local_heads, local_kv = model.n_heads // dist.tp, model.kv_heads // dist.tp
    if local_heads % cp:
        raise ConfigError(
            _FIELD,
            cp,
            f"a divisor of {_heads_where('n_heads', model.n_heads, dist.tp)}",
            "attention gives each context-parallel rank whole query heads of the full "
            "sequence, so cp can be at most the query heads",
        )
    if local_kv % cp and cp % local_kv:
        raise ConfigError(
            _FIELD,
            cp,
            f"a divisor or a multiple of {_heads_where('n_kv_heads', model.kv_heads, dist.tp)}",
            "each context-parallel rank takes whole key/value heads, or one head that "
            "several ranks share (repeated to them) when there are fewer heads than ranks",
        )
    if is_vlm:
        raise ConfigError(
            _FIELD,
            cp,
            "1 with a vision-language model ([vlm])",
            "context parallelism runs with data, tensor, pipeline and expert parallelism, "
            "compiled blocks and MoE models; set distributed.cp = 1 or leave [vlm] out",
        )


def _heads_where(name: str, heads: int, tp: int) -> str:
    """How a head count reads in a message, per tensor-parallel rank when tp splits it."""
    if tp > 1:
        return f"model.{name} / distributed.tp = {heads} / {tp} = {heads // tp}"
    return f"model.{name} = {heads}"
