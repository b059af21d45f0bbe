"""Context parallelism: give a model its SequenceSplit and each rank its slice of a batch.

The ``cp`` ranks of a mesh read the same batches (they share a data-parallel rank); each
keeps its 1/cp of every sequence's positions (slice_batch: a contiguous slice, or under
ring attention two zigzag chunks' worth, as held_spans says; a vision-language model's
sequence counts its image tokens before the text), and the model exchanges attention
heads over the ``cp`` group, or passes key/value blocks around its ring
(model/attention/sequence_split.py, ring.py). They hold the same weights, so FSDP shards
and averages over ``dp_shard_cp`` (fsdp.py), and the step's loss and token counts are
summed over ``dp_cp`` (training/accumulate.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.attention import SequenceSplit, held_parts, set_sequence_split

SPLIT_KEYS = ("input_ids", "labels")
"""Per-position batch entries each cp rank keeps a slice of. ``doc_ids`` stays whole:
attention masks the whole sequence (or each chunk pair of a ring) as one process does."""


def apply_cp(model: nn.Module, runtime: RuntimeContext) -> None:
    """Make ``model`` take this rank's slice of each sequence (no-op without cp)."""
    group = runtime.group("cp")
    if group is None:
        return
    split = SequenceSplit(
        group,
        runtime.cp_rank,
        runtime.cp_size,
        ring=runtime.cp_ring,
        ulysses_group=runtime.group("cp_ulysses"),
    )
    set_sequence_split(model, split)


def slice_batch(
    batch: dict[str, torch.Tensor], runtime: RuntimeContext, prefix_len: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's slice of a (batch, seq) batch: the input_ids and labels of its positions
    of the model's sequence; the batch itself without cp.

    The model's sequence is ``prefix_len`` positions it makes itself (a joint decoder's
    image tokens), then the batch's ``seq`` positions; cp rank r holds ``(prefix_len +
    seq) / cp`` of them (held_spans): ``[r * s, (r + 1) * s)``, or under ring attention
    its share of two chunks, an early and a late one. Its ids and labels are those of its
    positions past the prefix, in order: a rank whose positions are all image tokens keeps
    no text, the rank where the text starts fewer ids. Everything else (doc_ids,
    pixel_values) stays whole. JobConfig.validate checked that cp divides the sequence.
    """
    if runtime.cp_size == 1:
        return batch
    out = dict(batch)
    for key in SPLIT_KEYS:
        if key in batch:
            end = prefix_len + batch[key].shape[1]
            parts = held_parts(
                runtime.cp_rank, runtime.cp_size, end, prefix_len, end, runtime.cp_ring
            )
            held = [batch[key][:, part] for part in parts] or [batch[key][:, :0]]
            out[key] = held[0] if len(held) == 1 else torch.cat(held, dim=1)
    return out
