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


def cp_degrees(config: JobConfig) -> tuple[int, int]:
    """(Ulysses ranks, ring ranks) of the job's context parallelism; their product is
    distributed.cp, and (1, 1) without it.

    'ulysses' is (cp, 1). 'ring' is (cp_ulysses, cp / cp_ulysses), a pure ring (1, cp)
    when cp_ulysses is 0. 'auto' takes cp_ulysses where it is set, else the largest divisor
    of cp the heads allow as Ulysses ranks: cp itself where they allow it (no ring).
    """
    dist = config.distributed
    cp = dist.cp
    if cp == 1 or dist.cp_attention == "ulysses":
        return cp, 1
    if dist.cp_ulysses:
        return dist.cp_ulysses, cp // dist.cp_ulysses
    if dist.cp_attention == "ring":
        return 1, cp
    heads, kv = _local_heads(config)
    ulysses = max(u for u in range(1, cp + 1) if cp % u == 0 and _heads_allow(u, heads, kv))
    return ulysses, cp // ulysses


def cp_ring(config: JobConfig) -> int:
    """Ranks of the job's key/value ring: 1 without one (heads only, or no cp)."""
    return cp_degrees(config)[1]


def check_context_parallel(config: JobConfig) -> None:
    """Refuse a cp the sequence or the heads cannot split.

    Each cp rank holds 1/cp of every sequence's positions: train.seq_len for a text model;
    for a vision-language model the decoder's sequence, the image tokens then
    vlm.max_text_len text positions with the joint decoder, the text alone with
    cross-attention (the vision encoder is read from its config files to count the image
    tokens). A ring of r ranks cuts it into 2 * r chunks. The Ulysses ranks (all cp ranks
    without a ring) exchange their positions for whole heads (all-to-all), so their number
    must divide the query heads (per tp rank, where tensor parallelism splits them first),
    and divide the key/value heads or be a multiple of them: with fewer key/value heads
    than ranks, each is repeated to the ranks whose query heads read it
    (model/attention/sequence_split.py).
    """
    cp = config.distributed.cp
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
    ulysses, ring = cp_degrees(config)
    if ring > 1 and seq_len % (2 * ring):
        raise ConfigError(
            _FIELD,
            cp,
            f"a layout whose ring of {ring} ranks (cp / cp_ulysses) cuts {named} into "
            f"{2 * ring} equal chunks",
            "each ring rank holds two chunks, an early and a late one; set "
            "distributed.cp_ulysses or train.seq_len so that 2 * ring divides it",
        )
    _check_ulysses_heads(config, ulysses, ring)


def _check_ulysses_heads(config: JobConfig, ulysses: int, ring: int) -> None:
    """The Ulysses ranks against the heads of a tp rank."""
    dist, model = config.distributed, config.model
    heads, kv = _local_heads(config)
    field = _FIELD if ring == 1 else "distributed.cp_ulysses"
    past = (
        "; or distributed.cp_attention = 'ring' (or 'auto') to pass keys and values around "
        "a ring past the head count"
        if ring == 1
        else ""
    )
    if heads % ulysses:
        raise ConfigError(
            field,
            ulysses,
            f"a divisor of {_heads_where('n_heads', model.n_heads, dist.tp)}",
            "attention gives each Ulysses rank whole query heads of the full sequence, so "
            f"there can be at most as many as query heads{past}",
        )
    if kv % ulysses and ulysses % kv:
        raise ConfigError(
            field,
            ulysses,
            f"a divisor or a multiple of {_heads_where('n_kv_heads', model.kv_heads, dist.tp)}",
            "each Ulysses rank takes whole key/value heads, or one head that several ranks "
            f"share (repeated to them) when there are fewer heads than ranks{past}",
        )


def _local_heads(config: JobConfig) -> tuple[int, int]:
    """(query heads, key/value heads) of one tp rank: tensor parallelism splits them first
    (JobConfig checked that tp divides them)."""
    dist, model = config.distributed, config.model
    return model.n_heads // dist.tp, model.kv_heads // dist.tp


def _heads_allow(ulysses: int, heads: int, kv: int) -> bool:
    """Whether ``ulysses`` ranks can exchange ``heads`` query and ``kv`` key/value heads."""
    return heads % ulysses == 0 and (kv % ulysses == 0 or ulysses % kv == 0)


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
