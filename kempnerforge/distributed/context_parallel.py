"""Context parallelism: give a model its SequenceSplit and each rank its slice of a batch.

The ``cp`` ranks of a mesh read the same batches (they share a data-parallel rank); each
keeps its contiguous 1/cp of every sequence's positions (slice_batch), and the model
exchanges attention heads over the ``cp`` group (model/sequence_split.py). They hold the
same weights, so FSDP shards and averages over ``dp_shard_cp`` (fsdp.py), and the
step's loss and token counts are summed over ``dp_cp`` (training/accumulate.py).
"""

from __future__ import annotations

import torch
from torch import nn

from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.sequence_split import SequenceSplit, set_sequence_split

SPLIT_KEYS = ("input_ids", "labels")
"""Per-position batch entries each cp rank keeps a slice of. ``doc_ids`` stays whole:
attention sees the whole sequence and masks it as one process does."""


def apply_cp(model: nn.Module, runtime: RuntimeContext) -> None:
    """Make ``model`` take this rank's slice of each sequence (no-op without cp)."""
    group = runtime.group("cp")
    if group is None:
        return
    set_sequence_split(model, SequenceSplit(group, runtime.cp_rank, runtime.cp_size))


def slice_batch(batch: dict[str, torch.Tensor], runtime: RuntimeContext) -> dict[str, torch.Tensor]:
    """This rank's slice of a (batch, seq) batch: positions ``[r * s, (r + 1) * s)`` of
    input_ids and labels for cp rank r and ``s = seq / cp``; the batch itself without cp.

    JobConfig.validate checked that cp divides train.seq_len.
    """
    if runtime.cp_size == 1:
        return batch
    out = dict(batch)
    for key in SPLIT_KEYS:
        if key in batch:
            local_len = batch[key].shape[1] // runtime.cp_size
            first = runtime.cp_rank * local_len
            out[key] = batch[key][:, first : first + local_len]
    return out
