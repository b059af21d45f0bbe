"""MixtureOrder: which source and window each position of a mixture epoch reads, in O(1)."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

from kempnerforge.data.sampling.permutation import KeyedPermutation, derive_key, subkey

CHUNK_LEN = 1024
"""Positions per chunk. Every chunk holds each source's share of its positions, placed by
a keyed permutation of the chunk; a source's reads advance chunk by chunk."""


def quotas(length: int, probabilities: Sequence[float]) -> list[int]:
    """Positions per source out of ``length``: ``length * p_s`` by largest remainder.

    Exact rational arithmetic on the given floats, so every platform rounds alike; ties go
    to the lower source index. A zero probability gets no position.
    """
    exact = [Fraction(p) for p in probabilities]
    total = sum(exact)
    ideal = [length * p / total for p in exact]
    counts = [math.floor(q) for q in ideal]
    by_remainder = sorted(range(len(ideal)), key=lambda s: (counts[s] - ideal[s], s))
    for s in by_remainder[: length - sum(counts)]:
        counts[s] += 1
    return counts


def cumulative_counts(x: int, counts: Sequence[int]) -> list[int]:
    """How many of a segment's first ``x`` slots each source holds.

    The slots of ``sum(counts)`` are split source by source: source s takes its rounded
    share of what the sources before it left. Each source's count never decreases as
    ``x`` grows (so the difference between two chunk boundaries is the chunk's count),
    the counts add up to ``x``, and at ``x = sum(counts)`` they are ``counts``.
    """
    out = []
    rest, rest_total = x, sum(counts)
    for n in counts[:-1]:
        share = (rest * n + rest_total // 2) // rest_total if rest_total else 0
        out.append(share)
        rest, rest_total = rest - share, rest_total - n
    out.append(rest)
    return out


@dataclass(frozen=True)
class Segment:
    """The positions from ``start`` to the epoch's end under one set of probabilities.

    A later segment (a weight change) cuts it short. ``counts`` are its positions per
    source as if it ran to the epoch's end; ``bases`` the ordinals each source read before
    it, so its reads continue where the earlier segments' stopped.
    """

    start: int
    counts: tuple[int, ...]
    bases: tuple[int, ...]
    key: int

    @property
    def length(self) -> int:
        return sum(self.counts)


class MixtureOrder:
    """The source and window at every position of one mixture epoch, each in O(1).

    A segment's probabilities hold from its start to the next segment's (a weight change).
    In a segment, each chunk of CHUNK_LEN positions gives every source its share
    (``cumulative_counts`` at the chunk's two ends), and a keyed permutation of the chunk
    scatters the shares: position p goes to slot x, and the source whose block of slots
    holds x reads at p. Its ordinal there is ``base + (its count before the chunk) + (x -
    start of its block)``: a source's ordinals are consecutive integers, each read once,
    rising chunk by chunk (shuffled within one).

    Ordinal k of source s reads window ``perm_(s, k // size_s)(k mod size_s)``: pass after
    pass of a fresh permutation of the source, each window once per pass.

    After a weight change at P, each source's ordinals continue from the end of the chunk
    holding P: those the earlier segment planned for the rest of that chunk (fewer than
    CHUNK_LEN in all) are skipped, never reused, so no pass reads a window twice.
    """

    def __init__(
        self,
        sizes: Sequence[int],
        seed: int,
        epoch: int,
        probabilities: Sequence[tuple[int, Sequence[float]]],
    ) -> None:
        """``probabilities``: (first position, per-source probabilities), by position."""
        self.sizes = list(sizes)
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)
        self.length = self.offsets[-1]
        self._seed, self._epoch = seed, epoch
        self.segments: list[Segment] = []
        self._starts: list[int] = []
        for start, probs in probabilities:
            self._add_segment(start, probs)
        self._source_keys = [
            derive_key("mixture-source", seed, epoch, s) for s in range(len(self.sizes))
        ]
        self._chunk: tuple[tuple[int, int], list[int], list[int], KeyedPermutation] | None = None
        self._passes: dict[int, tuple[int, KeyedPermutation]] = {}

    def _add_segment(self, start: int, probs: Sequence[float]) -> None:
        if not 0 <= start <= self.length:
            raise ValueError(f"a segment start must be in [0, {self.length}], got {start}")
        bases = [0] * len(self.sizes)
        if not self.segments and start != 0:
            raise ValueError(f"the first segment must start at position 0, got {start}")
        if self.segments:
            prev = self.segments[-1]
            if start < prev.start:
                raise ValueError(f"segments must start in order, got {start} after {prev.start}")
            end = min(-(-(start - prev.start) // CHUNK_LEN) * CHUNK_LEN, prev.length)
            read = cumulative_counts(end, prev.counts)
            bases = [b + r for b, r in zip(prev.bases, read, strict=True)]
        key = derive_key("mixture", self._seed, self._epoch, start)
        counts = tuple(quotas(self.length - start, probs))
        self.segments.append(Segment(start, counts, tuple(bases), key))
        self._starts.append(start)

    def locate(self, position: int) -> tuple[int, int]:
        """(source, ordinal of the source's read) at ``position``."""
        if not 0 <= position < self.length:
            raise IndexError(f"position {position} out of range [0, {self.length})")
        which = bisect.bisect_right(self._starts, position) - 1
        segment = self.segments[which]
        chunk, slot = divmod(position - segment.start, CHUNK_LEN)
        before, after, perm = self._chunk_plan(which, chunk)
        x = perm(slot)
        block = 0
        for source, (low, high) in enumerate(zip(before, after, strict=True)):
            if x < block + high - low:
                return source, segment.bases[source] + low + x - block
            block += high - low
        raise AssertionError("chunk counts do not add up to the chunk")

    def _chunk_plan(self, which: int, chunk: int) -> tuple[list[int], list[int], KeyedPermutation]:
        """Per-source counts before and after a chunk, and its permutation (last one kept)."""
        cached = self._chunk
        if cached is None or cached[0] != (which, chunk):
            segment = self.segments[which]
            first = chunk * CHUNK_LEN
            last = min(first + CHUNK_LEN, segment.length)
            perm = KeyedPermutation(last - first, subkey(segment.key, chunk))
            before = cumulative_counts(first, segment.counts)
            after = cumulative_counts(last, segment.counts)
            cached = self._chunk = ((which, chunk), before, after, perm)
        return cached[1], cached[2], cached[3]

    def window(self, source: int, ordinal: int) -> int:
        """The window of ``source`` its read number ``ordinal`` takes."""
        size = self.sizes[source]
        pass_, k = divmod(ordinal, size)
        cached = self._passes.get(source)
        if cached is None or cached[0] != pass_:
            perm = KeyedPermutation(size, subkey(self._source_keys[source], pass_))
            cached = self._passes[source] = (pass_, perm)
        return cached[1](k)

    def global_index(self, position: int) -> int:
        """The MixtureDataset index read at ``position``."""
        source, ordinal = self.locate(position)
        return self.offsets[source] + self.window(source, ordinal)
