"""MixtureOrder: exact shares, each source's reads in full passes, weight changes, any dp_size."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kempnerforge.data.sampling.mixture import MixtureSampler
from kempnerforge.data.sampling.mixture_order import (
    CHUNK_LEN,
    MixtureOrder,
    cumulative_counts,
    quotas,
)

SIZES = [50, 3000, 7]  # 3057 positions: three chunks, the last one short
PROBS = [0.5, 0.3, 0.2]


def _located(order: MixtureOrder, positions: range) -> list[tuple[int, int]]:
    return [order.locate(p) for p in positions]


def test_quotas_round_by_largest_remainder():
    assert quotas(10, [0.5, 0.25, 0.25]) == [5, 3, 2]  # 2.5 and 2.5: the lower index wins
    assert quotas(7, [1 / 3, 1 / 3, 1 / 3]) == [3, 2, 2]
    assert quotas(5, [0.0, 1.0, 0.0]) == [0, 5, 0]
    assert quotas(0, [0.3, 0.7]) == [0, 0]
    assert quotas(10**12, [0.4, 0.6]) == [4 * 10**11, 6 * 10**11]
    rng = random.Random(0)
    for _ in range(200):
        probs = [rng.choice([0.0, rng.random()]) for _ in range(rng.randint(1, 6))] + [0.1]
        length = rng.randint(0, 10**6)
        counts = quotas(length, probs)
        total = sum(probs)
        assert sum(counts) == length
        assert all(abs(c - length * p / total) < 1 for c, p in zip(counts, probs, strict=True))
        assert all(c == 0 for c, p in zip(counts, probs, strict=True) if p == 0)


@pytest.mark.parametrize("counts", [[5, 3, 2], [0, 7, 0, 1], [1], [13, 0], [3, 3, 3, 3, 3]])
def test_cumulative_counts_grow_one_slot_at_a_time_and_end_at_the_counts(counts):
    previous = cumulative_counts(0, counts)
    assert previous == [0] * len(counts)
    for x in range(1, sum(counts) + 1):
        current = cumulative_counts(x, counts)
        assert sum(current) == x
        steps = [c - p for c, p in zip(current, previous, strict=True)]
        assert sorted(steps) == [0] * (len(counts) - 1) + [1]
        previous = current
    assert previous == counts


def test_each_source_reads_its_ordinals_once_and_chunk_by_chunk():
    order = MixtureOrder(SIZES, 3, 0, [(0, PROBS)])
    located = _located(order, range(sum(SIZES)))
    shares = quotas(sum(SIZES), PROBS)
    for source, share in enumerate(shares):
        ordinals = [k for s, k in located if s == source]
        assert sorted(ordinals) == list(range(share))  # a bijection onto [0, share)
        # Reads advance chunk by chunk: every ordinal of a chunk is below the next chunk's.
        chunks = [
            [k for s, k in located[c : c + CHUNK_LEN] if s == source]
            for c in range(0, len(located), CHUNK_LEN)
        ]
        for a, b in zip(chunks, chunks[1:], strict=False):
            assert max(a) < min(b)
        # Within a chunk they are shuffled, not in position order.
        assert chunks[0] != sorted(chunks[0])
    # Each full chunk holds each source's share of it, give or take rounding.
    for c in range(0, 2 * CHUNK_LEN, CHUNK_LEN):
        counts = Counter(s for s, _ in located[c : c + CHUNK_LEN])
        assert all(abs(counts[s] - CHUNK_LEN * p) <= 1 for s, p in enumerate(PROBS))


def test_a_source_is_read_in_full_passes_of_fresh_permutations():
    order = MixtureOrder(SIZES, 3, 0, [(0, PROBS)])
    size = SIZES[2]
    share = quotas(sum(SIZES), PROBS)[2]  # 611 reads of 7 windows: 87 passes and 2 more
    passes = [[order.window(2, k) for k in range(j * size, (j + 1) * size)] for j in range(87)]
    assert all(sorted(p) == list(range(size)) for p in passes)
    assert len({tuple(p) for p in passes}) > 40  # each pass has its own permutation
    drawn = [order.global_index(p) for p in range(sum(SIZES))]
    small = Counter(i - SIZES[0] - SIZES[1] for i in drawn if i >= SIZES[0] + SIZES[1])
    assert sorted(small.values()) == [87] * 5 + [88] * 2 and sum(small.values()) == share
    big = [i for i in drawn if SIZES[0] <= i < SIZES[0] + SIZES[1]]
    assert len(big) == len(set(big))  # 917 of 3000 windows: never one twice


@pytest.mark.parametrize("change_at", [1500, 2048, 100])
def test_a_weight_change_keeps_the_past_and_continues_each_source(change_at):
    new_probs = [0.1, 0.1, 0.8]
    before = MixtureOrder(SIZES, 3, 0, [(0, PROBS)])
    after = MixtureOrder(SIZES, 3, 0, [(0, PROBS), (change_at, new_probs)])
    length = sum(SIZES)
    head = range(change_at)
    assert _located(after, head) == _located(before, head)
    assert [after.global_index(p) for p in head] == [before.global_index(p) for p in head]
    tail = _located(after, range(change_at, length))
    assert [sum(s == i for s, _ in tail) for i in range(3)] == quotas(length - change_at, new_probs)
    read = _located(after, range(length))
    skipped = 0
    for source in range(3):
        ordinals = sorted(k for s, k in read if s == source)
        assert len(ordinals) == len(set(ordinals))  # no read twice: no window twice a pass
        earlier = [k for s, k in read[:change_at] if s == source]
        later = [k for s, k in tail if s == source]
        assert not earlier or not later or max(earlier) < min(later)
        skipped += ordinals[-1] + 1 - len(ordinals)
    # At most the rest of the chunk the change fell in; nothing at a chunk's end.
    assert skipped < CHUNK_LEN and (skipped == 0) == (change_at % CHUNK_LEN == 0)


def test_the_epoch_and_seed_key_the_order():
    def sequence(seed: int, epoch: int) -> list[int]:
        order = MixtureOrder(SIZES, seed, epoch, [(0, PROBS)])
        return [order.global_index(p) for p in range(200)]

    assert sequence(1, 0) == sequence(1, 0)
    assert len({tuple(sequence(s, e)) for s in range(2) for e in range(2)}) == 4


def test_a_weight_change_draws_the_same_global_sequence_at_any_dp_size():
    def run(dp_size: int) -> list[int]:
        """All ranks' draws interleaved by position, switching at global position 24."""
        ranks = [MixtureSampler([40, 30], [1, 1], 1.0, r, dp_size, seed=8) for r in range(dp_size)]
        iters = [iter(s) for s in ranks]
        drawn = []
        for position in range(70 // dp_size):
            if position * dp_size == 24:
                for sampler in ranks:
                    sampler.update_weights([1, 4])
            drawn += [next(it) for it in iters]
        return drawn

    one, two, three = run(1), run(2), run(3)
    assert one[:69] == two[:69] and one[:69] == three
    assert run(1) != list(MixtureSampler([40, 30], [1, 1], 1.0, 0, 1, seed=8))
