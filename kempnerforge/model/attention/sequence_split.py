"""Context parallelism inside the model: each rank holds a slice of every sequence, and
attention trades it for whole-sequence heads (all-to-all) and back.

Rank r of a ``cp``-rank group holds positions ``[r * s, (r + 1) * s)`` of every sequence
(``s = seq_len / cp``). Before attention, one all-to-all per q, k and v turns "my positions,
every head" into "every position, my heads" (query heads ``[r * H / cp, (r + 1) * H / cp)``
and the matching key/value heads, so grouped-query pairs stay together; with fewer
key/value heads than ranks, each is repeated so that every rank gets the one its query
heads read); attention then runs
over the whole sequence with the same causal or document mask as one process, and one
all-to-all brings its output back to "my positions, every head". Every rank does the same
work whatever its slice, so causal attention needs no load balancing. Both directions are
differentiable: backward runs the mirrored exchange. The exchange is a functional
collective, which torch.compile traces, so a compiled block keeps it inside its graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed import ProcessGroup

# The functional all-to-all carries autograd (also on gloo).
from torch.distributed._functional_collectives import (
    AsyncCollectiveTensor,
    all_to_all_single_autograd,
)


@dataclass
class SequenceSplit:
    """How a model's sequences are split over its context-parallel group.

    One instance is shared by the model and each of its attention layers, so switching
    ``active`` off (whole_sequences) makes the whole model run unsplit sequences.
    """

    group: ProcessGroup
    rank: int
    size: int
    active: bool = True

    def offset(self, local_len: int) -> int:
        """The global position of this rank's first token for slices of ``local_len``."""
        return self.rank * local_len


def held_span(rank: int, size: int, seq_len: int, start: int, stop: int) -> slice:
    """The part of positions ``[start, stop)`` of a ``seq_len``-long sequence that rank
    ``rank`` of a ``size``-rank group holds, relative to ``start``.

    Rank r holds ``[r * s, (r + 1) * s)`` with ``s = seq_len / size``; ``[start, stop)`` is
    one segment of the sequence (a vision-language model's image tokens, or the text after
    them), so the answer may be empty. With one rank it is the whole segment.
    """
    local_len = seq_len // size
    first = min(max(rank * local_len, start), stop)
    last = min(max((rank + 1) * local_len, start), stop)
    return slice(first - start, last - start)


def active_split(module: nn.Module) -> SequenceSplit | None:
    """The module's SequenceSplit while it is in effect; None otherwise."""
    split = getattr(module, "sequence_split", None)
    return split if split is not None and split.active else None


def set_sequence_split(model: nn.Module, split: SequenceSplit) -> None:
    """Attach ``split`` to every module that reads it (the model and its attention layers)."""
    for module in model.modules():
        if hasattr(module, "sequence_split"):
            # setattr: nn.Module.__setattr__ is typed for tensors and modules only.
            setattr(module, "sequence_split", split)  # noqa: B010


@contextlib.contextmanager
def whole_sequences(model: nn.Module) -> Iterator[None]:
    """Run ``model`` on whole sequences inside the block (the end-of-run sample, whose
    windows are not split); every context-parallel rank then computes the same tokens."""
    split = getattr(model, "sequence_split", None)
    if split is None:
        yield
        return
    was, split.active = split.active, False
    try:
        yield
    finally:
        split.active = was


def sequence_to_heads(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """(batch, seq / cp, heads, dim) slices -> (batch, seq, heads / cp, dim) whole sequences."""
    batch, local_len, heads, dim = x.shape
    cp = split.size
    # Chunk j of the heads goes to rank j; what arrives from rank j is its positions.
    send = x.reshape(batch, local_len, cp, heads // cp, dim).permute(2, 0, 1, 3, 4)
    got = _exchange(send.contiguous(), split.group)
    return got.permute(1, 0, 2, 3, 4).reshape(batch, cp * local_len, heads // cp, dim)


def kv_sequence_to_heads(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """sequence_to_heads for key/value heads, which may be fewer than the ranks.

    With ``kv`` heads and ``cp`` a multiple of ``kv``, each head is repeated ``cp / kv``
    times first, so rank r receives one head, the one its query heads read (``r // (cp /
    kv)``: query heads ``[r * H / cp, (r + 1) * H / cp)`` all fall in that head's
    group). The exchange then carries ``cp / kv`` copies of each head instead of one; the
    copies' gradients sum back into the head's.
    """
    heads = x.shape[2]
    if heads < split.size:
        x = x.repeat_interleave(split.size // heads, dim=2)
    return sequence_to_heads(x, split)


def heads_to_sequence(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """(batch, seq, heads / cp, dim) -> (batch, seq / cp, heads, dim): sequence_to_heads undone."""
    batch, seq_len, local_heads, dim = x.shape
    cp = split.size
    local_len = seq_len // cp
    # Chunk j of the positions goes to rank j; what arrives from rank j is its heads.
    send = x.reshape(batch, cp, local_len, local_heads, dim).transpose(0, 1)
    got = _exchange(send.contiguous(), split.group)
    return got.permute(1, 2, 0, 3, 4).reshape(batch, local_len, cp * local_heads, dim)


def _exchange(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable even all-to-all along dim 0; a plain tensor, already waited on."""
    y = all_to_all_single_autograd(x, None, None, group)
    return y.wait() if isinstance(y, AsyncCollectiveTensor) else y
