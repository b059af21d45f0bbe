"""The rules distributed.cp (context parallelism) sets on the rest of a job's config.

Checked in JobConfig.validate, on every rank before any collective, so a layout that
context parallelism cannot run stops with one ConfigError everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kempnerforge.core.errors import ConfigError

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig

_FIELD = "distributed.cp"


def check_context_parallel(config: JobConfig) -> None:
    """Refuse a cp the sequence or the heads cannot split.

    Each cp rank holds 1/cp of every sequence's positions: train.seq_len for a text model;
    for a vision-language model the decoder's sequence, the image tokens then
    vlm.max_text_len text positions with the joint decoder, the text alone with
    cross-attention (the vision encoder is read from its config files to count the image
    tokens). Attention exchanges the positions for n_heads / cp query heads of the whole
    sequence and their key/value heads (all-to-all), so cp must divide the query heads
    (per tp rank, where tensor parallelism splits them first), and divide the key/value
    heads or be a multiple of them: with fewer key/value heads than ranks, each is
    repeated to the ranks whose query heads read it (model/attention/sequence_split.py).
    """
    dist, model = config.distributed, config.model
    cp = dist.cp
    if cp == 1:
        return
    seq_len, named = _split_sequence(config)
    if seq_len % cp:
        raise ConfigError(
            _FIELD,
            cp,
            f"a divisor of {named}",
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


def _split_sequence(config: JobConfig) -> tuple[int, str]:
    """The length of the sequence cp splits, and how a message names it."""
    vlm = config.vlm
    if vlm is None:
        return config.train.seq_len, f"train.seq_len = {config.train.seq_len}"
    text = vlm.max_text_len
    if vlm.arch != "joint_decoder":
        return text, f"vlm.max_text_len = {text} (the cross-attention decoder's sequence)"
    image = config.image_tokens(config.vision_spec())
    return image + text, (
        f"the joint decoder's sequence, image tokens + vlm.max_text_len = {image} + {text} "
        f"= {image + text}"
    )


def _heads_where(name: str, heads: int, tp: int) -> str:
    """How a head count reads in a message, per tensor-parallel rank when tp splits it."""
    if tp > 1:
        return f"model.{name} / distributed.tp = {heads} / {tp} = {heads // tp}"
    return f"model.{name} = {heads}"
