"""Context parallelism inside the model: each rank holds a slice of every sequence, and
attention trades it for whole-sequence heads (all-to-all) and back, or, past the head
count, passes key/value blocks around a ring of ranks (ring.py).

Which positions a rank holds is held_spans' rule. With heads only (the Ulysses scheme),
rank r of a ``cp``-rank group holds positions ``[r * s, (r + 1) * s)`` of every sequence
(``s = seq_len / cp``). Before attention, one all-to-all per q, k and v turns "my
positions, every head" into "every position, my heads" (query heads ``[r * H / cp, (r + 1)
* H / cp)`` and the matching key/value heads, so grouped-query pairs stay together; with
fewer key/value heads than ranks, each is repeated so that every rank gets the one its
query heads read); attention then runs over the whole sequence with the same causal or
document mask as one process, and one all-to-all brings its output back to "my positions,
every head". Every rank does the same work whatever its slice, so causal attention needs
no load balancing. Both directions are differentiable: backward runs the mirrored
exchange. The exchange is a functional collective, which torch.compile traces, so a
compiled block keeps it inside its graph.

With a ring (``SequenceSplit.ring`` > 1) the sequence is cut into ``2 * ring`` chunks and
ring rank i holds chunks i and ``2 * ring - 1 - i`` (zigzag: the early chunk sees little,
the late one much, so causal work is even over the ring); the ``cp / ring`` consecutive cp
ranks of one ring rank (its Ulysses group) split those two chunks between them in order,
and exchange heads inside the group as above before the ring runs over its chunks.
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
    """The whole context-parallel group."""
    rank: int
    """This rank's place in ``group``."""
    size: int
    """Ranks in ``group`` (distributed.cp)."""
    active: bool = True
    """False inside whole_sequences: the model then runs unsplit sequences."""
    ring: int = 1
    """Ranks of the key/value ring (model/attention/ring.py); 1: heads are exchanged over
    the whole group and no ring runs."""
    ulysses_group: ProcessGroup | None = None
    """With a ring of several ranks each (1 < ring < size): this rank's Ulysses group,
    the size / ring consecutive ranks that exchange heads; None otherwise."""

    @property
    def ulysses(self) -> int:
        """Ranks that exchange heads with each other: size / ring."""
        return self.size // self.ring

    @property
    def heads_group(self) -> ProcessGroup:
        """The group the head exchange runs over: the Ulysses group, else the whole one."""
        return self.ulysses_group if self.ulysses_group is not None else self.group

    def spans(self, local_len: int) -> list[tuple[int, int]]:
        """The global positions ``[a, b)`` this rank holds for slices of ``local_len``, in
        the order its slice holds them (held_spans)."""
        return held_spans(self.rank, self.size, local_len * self.size, self.ring)


def held_spans(rank: int, size: int, seq_len: int, ring: int = 1) -> list[tuple[int, int]]:
    """The positions ``[a, b)`` of a ``seq_len``-long sequence that rank ``rank`` of a
    ``size``-rank context-parallel group holds, in increasing order: the order of its slice.

    Without a ring (``ring`` 1) that is ``[r * s, (r + 1) * s)`` with ``s = seq_len / size``.
    With one, ring rank ``i = rank // (size / ring)`` holds chunks i and ``2 * ring - 1 - i``
    of ``2 * ring`` equal chunks, and rank ``rank % (size / ring)`` of its Ulysses group the
    matching 1 / (size / ring) of those two chunks taken together: one span or two. Every
    rank holds seq_len / size positions; the ranks together hold each once.
    """
    if ring == 1:
        mine = [(0, seq_len)]
    else:
        chunk = seq_len // (2 * ring)
        i = rank // (size // ring)
        mine = [(i * chunk, (i + 1) * chunk), ((2 * ring - 1 - i) * chunk, (2 * ring - i) * chunk)]
    share = seq_len // size
    first = (rank % (size // ring)) * share
    spans, offset = [], 0
    for a, b in mine:
        lo, hi = max(first, offset), min(first + share, offset + b - a)
        if lo < hi:
            spans.append((a + lo - offset, a + hi - offset))
        offset += b - a
    return spans


def held_parts(
    rank: int, size: int, seq_len: int, start: int, stop: int, ring: int = 1
) -> list[slice]:
    """The parts of positions ``[start, stop)`` that rank ``rank`` holds (held_spans),
    relative to ``start`` and in order; ``[start, stop)`` is one segment of the sequence (a
    vision-language model's image tokens, or the text after them), so there may be none.
    With one rank it is the whole segment."""
    parts = []
    for a, b in held_spans(rank, size, seq_len, ring):
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            parts.append(slice(lo - start, hi - start))
    return parts


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
    """(batch, seq / u, heads, dim) slices -> (batch, seq, heads / u, dim) whole sequences,
    over the u = split.ulysses ranks of the head exchange (under a ring, ``seq`` is the ring
    rank's two chunks)."""
    batch, local_len, heads, dim = x.shape
    cp = split.ulysses
    # Chunk j of the heads goes to rank j; what arrives from rank j is its positions.
    send = x.reshape(batch, local_len, cp, heads // cp, dim).permute(2, 0, 1, 3, 4)
    got = _exchange(send.contiguous(), split.heads_group)
    return got.permute(1, 0, 2, 3, 4).reshape(batch, cp * local_len, heads // cp, dim)


def kv_sequence_to_heads(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """sequence_to_heads for key/value heads, which may be fewer than the ranks.

    With ``kv`` heads and ``u`` exchanging ranks, a multiple of ``kv``, each head is
    repeated ``u / kv`` times first, so rank r receives one head, the one its query heads
    read (``r // (u / kv)``: query heads ``[r * H / u, (r + 1) * H / u)`` all fall in that
    head's group). The exchange then carries ``u / kv`` copies of each head instead of one;
    the copies' gradients sum back into the head's.
    """
    heads = x.shape[2]
    if heads < split.ulysses:
        x = x.repeat_interleave(split.ulysses // heads, dim=2)
    return sequence_to_heads(x, split)


def exchanged_heads(per_head: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """The rows of ``per_head`` (heads, ...) of the query heads this rank holds after
    sequence_to_heads (a head's sink logit): heads ``[r * H / u, (r + 1) * H / u)`` for
    rank r of the u = split.ulysses ranks that exchange heads."""
    share = per_head.shape[0] // split.ulysses
    place = split.rank % split.ulysses
    return per_head[place * share : (place + 1) * share]


def heads_to_sequence(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """(batch, seq, heads / u, dim) -> (batch, seq / u, heads, dim): sequence_to_heads undone."""
    batch, seq_len, local_heads, dim = x.shape
    cp = split.ulysses
    local_len = seq_len // cp
    # Chunk j of the positions goes to rank j; what arrives from rank j is its heads.
    send = x.reshape(batch, cp, local_len, local_heads, dim).transpose(0, 1)
    got = _exchange(send.contiguous(), split.heads_group)
    return got.permute(1, 2, 0, 3, 4).reshape(batch, local_len, cp * local_heads, dim)


def _exchange(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Differentiable even all-to-all along dim 0; a plain tensor, already waited on."""
    y = all_to_all_single_autograd(x, None, None, group)
    return y.wait() if isinstance(y, AsyncCollectiveTensor) else y
