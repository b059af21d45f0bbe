"""Context parallelism: give a model its SequenceSplit and each rank its slice of a batch.

The ``cp`` ranks of a mesh read the same batches (they share a data-parallel rank); each
keeps its contiguous 1/cp of every sequence's positions (slice_batch; a vision-language
model's sequence counts its image tokens before the text), and the model
exchanges attention heads over the ``cp`` group (model/attention/sequence_split.py). They hold the
same weights, so FSDP shards and averages over ``dp_shard_cp`` (fsdp.py), and the
step's loss and token counts are summed over ``dp_cp`` (training/accumulate.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.attention import SequenceSplit, held_span, set_sequence_split

SPLIT_KEYS = ("input_ids", "labels")
"""Per-position batch entries each cp rank keeps a slice of. ``doc_ids`` stays whole:
attention sees the whole sequence and masks it as one process does."""


def apply_cp(model: nn.Module, runtime: RuntimeContext) -> None:
    """Make ``model`` take this rank's slice of each sequence (no-op without cp)."""
    group = runtime.group("cp")
    if group is None:
        return
    set_sequence_split(model, SequenceSplit(group, runtime.cp_rank, runtime.cp_size))


def slice_batch(
    batch: dict[str, torch.Tensor], runtime: RuntimeContext, prefix_len: int = 0
) -> dict[str, torch.Tensor]:
    """This rank's slice of a (batch, seq) batch: the input_ids and labels of its positions
    of the model's sequence; the batch itself without cp.

    The model's sequence is ``prefix_len`` positions it makes itself (a joint decoder's
    image tokens), then the batch's ``seq`` positions; cp rank r holds its positions
    ``[r * s, (r + 1) * s)`` with ``s = (prefix_len + seq) / cp`` (held_span). Without a
    prefix those are input_ids' and labels' positions ``[r * s, (r + 1) * s)``; with one,
    a rank whose positions are all image tokens keeps no text, and the rank where the text
    starts fewer than ``s`` ids. Everything else (doc_ids, pixel_values) stays whole.
    JobConfig.validate checked that cp divides the sequence.
    """
    if runtime.cp_size == 1:
        return batch
    out = dict(batch)
    for key in SPLIT_KEYS:
        if key in batch:
            seq_len = batch[key].shape[1]
            end = prefix_len + seq_len
            held = held_span(runtime.cp_rank, runtime.cp_size, end, prefix_len, end)
            out[key] = batch[key][:, held]
    return out
