"""PairSampler: a rank's share of a keyed per-epoch permutation of preference pairs, laid
out so each micro-batch holds whole pairs, its chosen rows first, then its rejected rows."""

from __future__ import annotations

from typing import Any

from kempnerforge.data.sampling.permutation import KeyedPermutation, derive_key
from kempnerforge.data.sampling.sampler import ShardedSampler


class PairSampler(ShardedSampler):
    """Sample the windows of a preference corpus (pair i is windows 2i, chosen, and 2i + 1,
    rejected: data/prepare/preference.py) for one data-parallel rank, epoch after epoch.

    Pairs, not windows, are shuffled: global pair position g of epoch e is pair ``perm(g)``
    of a KeyedPermutation of the pairs keyed by ``(seed, e)``, and rank r takes the pair
    positions ``r, r + dp_size, ...``. A micro-batch of ``batch_size`` rows is
    ``batch_size / 2`` of this rank's pairs: their chosen windows, then their rejected
    windows, in the same order (the layout the DPO objective reads). The epoch is the
    whole micro-batches every rank can fill. Each index is computed when drawn, O(1) memory;
    the position, state_dict and resume are ShardedSampler's (positions count windows).
    """

    def __init__(
        self,
        num_windows: int,
        batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 2 or batch_size % 2:
            raise ValueError(f"a pair micro-batch has an even number of rows, got {batch_size}")
        self.pairs_per_batch = batch_size // 2
        self.num_pairs = num_windows // 2
        super().__init__(num_windows, dp_rank, dp_size, seed, shuffle)

    @property
    def samples_per_rank(self) -> int:
        batches = self.num_pairs // self.dp_size // self.pairs_per_batch
        return 2 * batches * self.pairs_per_batch

    def permutation(self, epoch: int) -> KeyedPermutation:
        """The order of ``epoch``'s pairs, the same for every rank and ``dp_size``."""
        cached = self._permutation
        if cached is None or cached[0] != epoch:
            key = derive_key("pair_sampler", self.seed, epoch)
            cached = self._permutation = (epoch, KeyedPermutation(self.num_pairs, key))
        return cached[1]

    def rank_index(self, epoch: int, position: int) -> int:
        """This rank's ``position``-th window of ``epoch``: the chosen or rejected window of
        one of its pairs, as the micro-batch layout puts it."""
        return self._window(epoch, self.dp_rank, position)

    def global_index(self, epoch: int, position: int) -> int:
        """The window at global ``position`` of ``epoch``: rank ``position % dp_size``'s
        ``position // dp_size``-th (the base class's numbering of all ranks' draws)."""
        rank, rank_position = position % self.dp_size, position // self.dp_size
        return self._window(epoch, rank, rank_position)

    def _window(self, epoch: int, rank: int, position: int) -> int:
        if not 0 <= position < self.samples_per_rank:
            raise IndexError(
                f"position {position} is outside a rank's {self.samples_per_rank} windows "
                f"of epoch {epoch}"
            )
        batch, row = divmod(position, 2 * self.pairs_per_batch)
        rejected, slot = divmod(row, self.pairs_per_batch)
        pair_position = rank + (batch * self.pairs_per_batch + slot) * self.dp_size
        pair = self.permutation(epoch)(pair_position) if self.shuffle else pair_position
        return 2 * pair + rejected

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pairs_per_batch": self.pairs_per_batch}
