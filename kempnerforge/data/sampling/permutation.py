"""KeyedPermutation: a seeded bijection of [0, n), computed one position at a time."""

from __future__ import annotations

import hashlib

import numpy as np

MASK64 = (1 << 64) - 1
ROUNDS = 6
"""Feistel rounds; with a full 64-bit mixer as round function, 6 give a well-shuffled order."""
SMALL_ROUNDS = 12
"""Rounds for domains of at most 16 values (halves of 1 or 2 bits), which 6 rounds would
shuffle unevenly: some orders of 5 elements would come up twice as often as others."""

_STEP = 0x9E3779B97F4A7C15  # the 64-bit golden-ratio increment: consecutive inputs spread out
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def mix64(x: int) -> int:
    """A fixed bijective scramble of a 64-bit integer (the splitmix64 finaliser).

    Pure integer arithmetic, so every platform and Python version computes the same bits.
    """
    x &= MASK64
    x = ((x ^ (x >> 30)) * _MUL1) & MASK64
    x = ((x ^ (x >> 27)) * _MUL2) & MASK64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """mix64 over a uint64 array (numpy's uint64 products wrap modulo 2**64, as masked)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(_MUL1)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(_MUL2)
    return x ^ (x >> np.uint64(31))


def derive_key(*parts: int | str) -> int:
    """A 64-bit key for a tuple of ints and labels; distinct tuples get unrelated keys.

    A stable hash (sha256 of the parts' text), never Python's ``hash``, which is salted
    per process.
    """
    text = "kempnerforge-order:" + ":".join(str(part) for part in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def subkey(key: int, index: int) -> int:
    """The key of member ``index >= 0`` of a family keyed by ``key``, in O(1), no hashing."""
    return mix64(key ^ mix64((index + 1) * _STEP))


class KeyedPermutation:
    """A bijection of [0, n) chosen by ``key``, evaluated per index in O(1) memory.

    A balanced Feistel network over the smallest domain of 4**h >= n values (two halves of
    h bits) is a bijection of that domain; an index whose image lands at or past n is
    mapped again (cycle-walking) until it lands below n, which restricts the bijection to
    [0, n). The domain holds fewer than 4n values, so fewer than 4 rounds of walking are
    expected. Each round mixes one half with mix64 of the other and a round key drawn
    from ``key``.
    """

    def __init__(self, n: int, key: int) -> None:
        if n < 0:
            raise ValueError(f"a permutation needs n >= 0 elements, got {n}")
        self.n = n
        self.half_bits = max(1, ((n - 1).bit_length() + 1) // 2) if n > 1 else 1
        self._mask = (1 << self.half_bits) - 1
        rounds = ROUNDS if self.half_bits > 2 else SMALL_ROUNDS
        self._keys = tuple(mix64(key + (r + 1) * _STEP) for r in range(rounds))

    def __len__(self) -> int:
        return self.n

    def _feistel(self, x: int) -> int:
        bits, mask = self.half_bits, self._mask
        left, right = x >> bits, x & mask
        for key in self._keys:
            left, right = right, left ^ (mix64(right ^ key) & mask)
        return (left << bits) | right

    def __call__(self, index: int) -> int:
        """The image of ``index`` in [0, n)."""
        if not 0 <= index < self.n:
            raise IndexError(f"index {index} out of range [0, {self.n})")
        if self.n == 1:
            return 0
        x = self._feistel(index)
        while x >= self.n:
            x = self._feistel(x)
        return x

    def _feistel_array(self, x: np.ndarray) -> np.ndarray:
        bits, mask = np.uint64(self.half_bits), np.uint64(self._mask)
        left, right = x >> bits, x & mask
        for key in self._keys:
            left, right = right, left ^ (_mix64_array(right ^ np.uint64(key)) & mask)
        return (left << bits) | right

    def take(self, indices: np.ndarray | list[int]) -> np.ndarray:
        """The images of many indices at once (int64), equal to calling this per index."""
        index = np.asarray(indices, dtype=np.int64)
        if index.size and (index.min() < 0 or index.max() >= self.n):
            raise IndexError(f"indices out of range [0, {self.n})")
        if self.n <= 1:
            return index.copy()
        out = self._feistel_array(index.astype(np.uint64))
        walking = np.flatnonzero(out >= np.uint64(self.n))
        while walking.size:
            out[walking] = self._feistel_array(out[walking])
            walking = walking[out[walking] >= np.uint64(self.n)]
        return out.astype(np.int64)
