"""KeyedPermutation: a bijection of [0, n) for every n, chosen by its key, well shuffled."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kempnerforge.data.sampling.permutation import KeyedPermutation, derive_key, mix64, subkey


def _images(n: int, key: int) -> np.ndarray:
    return KeyedPermutation(n, key).take(np.arange(n))


def test_every_size_up_to_1500_is_a_bijection():
    for n in range(1501):
        images = _images(n, derive_key("test", n))
        assert np.array_equal(np.sort(images), np.arange(n)), n


@pytest.mark.parametrize("n", [2**16, 2**16 + 1, 2**17 - 1, 65_521, 104_729, 1_000_003])
def test_larger_primes_and_powers_of_two_are_bijections(n):
    images = _images(n, derive_key("test", n))
    assert np.array_equal(np.sort(images), np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 1000, 4097, 10**12])
def test_one_index_at_a_time_equals_the_vectorised_form(n):
    perm = KeyedPermutation(n, 12345)
    indices = np.unique(np.linspace(0, n - 1, num=min(n, 500)).astype(np.int64))
    assert [perm(int(i)) for i in indices] == perm.take(indices).tolist()
    assert all(0 <= perm(int(i)) < n for i in indices)


def test_zero_and_one_elements():
    empty = KeyedPermutation(0, 1)
    assert len(empty) == 0 and empty.take(np.arange(0)).tolist() == []
    with pytest.raises(IndexError, match=r"index 0 out of range \[0, 0\)"):
        empty(0)
    assert KeyedPermutation(1, 1)(0) == 0 and KeyedPermutation(1, 1).take([0]).tolist() == [0]
    with pytest.raises(IndexError):
        KeyedPermutation(5, 1)(5)
    with pytest.raises(IndexError):
        KeyedPermutation(5, 1).take([0, -1])
    with pytest.raises(ValueError, match="n >= 0"):
        KeyedPermutation(-1, 1)


def test_the_same_key_gives_the_same_order_and_other_keys_other_orders():
    n = 1000
    orders = {
        (seed, epoch): _images(n, derive_key("sampler", seed, epoch)).tolist()
        for seed in range(3)
        for epoch in range(3)
    }
    assert orders[(1, 2)] == _images(n, derive_key("sampler", 1, 2)).tolist()
    assert len({tuple(order) for order in orders.values()}) == len(orders)
    # Orders of different keys are unrelated: few positions agree (1 expected).
    a, b = orders[(0, 0)], orders[(0, 1)]
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 10


@pytest.mark.parametrize("n", [1000, 4096, 100_003])
def test_the_order_is_well_shuffled(n):
    images = _images(n, derive_key("shuffle", n))
    positions = np.arange(n)
    assert np.sum(images == positions) < 10  # fixed points: 1 expected
    # The mean displacement of a random permutation is n / 3, and it is spread out.
    displacement = np.abs(images - positions)
    assert abs(displacement.mean() - n / 3) < 0.03 * n
    assert displacement.std() > 0.2 * n
    # No linear structure between a position and its image, nor between neighbours.
    assert abs(np.corrcoef(positions, images)[0, 1]) < 0.05
    assert abs(np.corrcoef(images[:-1], images[1:])[0, 1]) < 0.05
    # Each tenth of the positions lands all over: every tenth of the range gets some.
    for part in np.array_split(images, 10):
        assert len(np.unique(part * 10 // n)) == 10


@pytest.mark.parametrize(("n", "num_keys"), [(3, 6000), (5, 12000)])
def test_small_orders_come_up_evenly_across_keys(n, num_keys):
    """A few-element domain is where a Feistel network shuffles worst: every order of 3
    elements, and every start (first three images) of an order of 5, is about as likely."""
    starts = Counter(
        tuple(KeyedPermutation(n, derive_key("even", n, k))(i) for i in range(3))
        for k in range(num_keys)
    )
    cells = n * (n - 1) * (n - 2)
    assert len(starts) == cells
    assert all(0.7 < count * cells / num_keys < 1.3 for count in starts.values())


def test_the_order_is_pinned_on_every_platform():
    """Changing any of these values changes every run's data: it needs a new ORDER_VERSION."""
    assert mix64(0) == 0 and mix64(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF  # splitmix64
    assert derive_key("sampler", 0, 0) == 0xA3C249D6EAF244F5
    assert subkey(7, 3) == 0x88D1E30F51A6F8B7
    assert [KeyedPermutation(10, 42)(i) for i in range(10)] == [6, 0, 7, 3, 1, 8, 4, 2, 5, 9]
    assert KeyedPermutation(10**12, 42)(123_456_789) == 619_062_155_513
