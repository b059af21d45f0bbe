"""The contract between a model family's model and the code that parallelises, initialises
and checkpoints it (distributed/, the build, inference loading).

Every family's model is a FamilyModel: it says where its decoder blocks are, which extra
modules FSDP shards as units of their own, and how it fills its weights. distributed/
types against these methods, so a new family's model plugs into every layout without an
edit there; nothing asks a model for an attribute it may not have.
"""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist
from torch import nn


class DecoderStack(Protocol):
    """A module that holds decoder blocks by their layer index, and the ends it may hold:
    the whole text decoder, or one pipeline stage of it (distributed/pipeline_parallel.py).

    Tensor parallelism splits the ends over the vocabulary and keeps the residual stream
    sequence-sharded only where one stack holds both ends."""

    @property
    def layers(self) -> nn.ModuleDict:
        """The blocks, keyed by their index in the whole model ("0", "1", ...)."""
        ...

    @property
    def tok_embeddings(self) -> nn.Embedding | None:
        """The token embedding; None on a stack that takes hidden states."""
        ...

    @property
    def norm(self) -> nn.Module | None:
        """The final norm before the head; None without the head."""
        ...

    @property
    def output(self) -> nn.Linear | None:
        """The output head; None on a stack that returns hidden states."""
        ...


class FamilyModel(nn.Module):
    """What every model family's model offers the layers above it.

    A subclass implements decoder_stacks and init_weights; a model whose only FSDP units
    are its decoder blocks keeps the empty defaults of fsdp_units and own_dtype_fsdp_units.
    """

    def __init__(self) -> None:
        super().__init__()
        self.pipeline_group: dist.ProcessGroup | None = None
        """On a pipeline rank, the group of its pipeline stages: the gradient norm sums
        every stage's squares over it (set by the build; None without pipelining)."""
        self.tied_head_copy = False
        """Whether this rank's output head is its own copy of the embedding another
        pipeline rank holds (model.tie_embeddings with the head and the embedding on
        different stages): kept equal to it by summing their gradients
        (distributed/tied_head.py), counted once in the gradient norm, and its optimizer
        state saved and loaded under the embedding's name (checkpoint/tied_head.py)."""
        self.embedding_copied = False
        """Whether this rank's embedding is tied to a head another pipeline rank holds as
        its copy (the other side of tied_head_copy)."""

    def decoder_stacks(self) -> list[DecoderStack]:
        """The modules holding this model's decoder blocks, in model order: where tensor
        parallelism, activation checkpointing, compile and FSDP find the blocks."""
        raise NotImplementedError(f"{type(self).__name__} must say where its decoder blocks are")

    def training_head_blocks(self) -> list[tuple[int, nn.Module]]:
        """Decoder blocks outside the stacks that only training runs (multi-token
        prediction's), as (index after the stacks' layers, block); none by default. FSDP,
        activation checkpointing and compile treat them as the stacks' blocks."""
        return []

    def fsdp_units(self) -> list[nn.Module]:
        """Modules besides the decoder blocks that FSDP shards as units of their own, in
        the parameter (mixed precision) dtype; none by default."""
        return []

    def own_dtype_fsdp_units(self) -> list[nn.Module]:
        """FSDP units that keep their parameters' own dtype in compute, whatever the mixed
        precision (a pretrained tower saved in another dtype); none by default."""
        return []

    def init_weights(self, seed: int | None = None) -> None:
        """Fill every parameter and buffer from ``seed`` alone (nothing to do on meta), so
        a sharded rank draws its slice of the single-process weights."""
        raise NotImplementedError(f"{type(self).__name__} must say how it fills its weights")
