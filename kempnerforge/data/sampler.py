"""ShardedSampler: this data-parallel rank's share of a seeded per-epoch permutation."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from kempnerforge.metrics.logging import get_logger

logger = get_logger(__name__)


def epoch_seed(seed: int, epoch: int) -> int:
    """A generator seed for one epoch; distinct (seed, epoch) pairs never share one."""
    digest = hashlib.sha256(f"kempnerforge-sampler:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ShardedSampler(Sampler[int]):
    """Sample indices for one data-parallel rank, epoch after epoch.

    Each epoch permutes ``range(num_samples)`` with a torch.Generator seeded from
    ``(seed, epoch)`` (identical on every rank and machine), drops the tail that does not
    divide by ``dp_size`` and gives rank r the positions ``r::dp_size``. Ranks' shards are
    disjoint, equally long, and together form the truncated permutation.

    The epoch advances when an epoch's iterator runs out. ``state_dict`` holds the epoch and
    how many indices this epoch has handed out; StatefulDataLoader saves and restores it (with
    workers, its snapshots account for prefetched batches), and a fresh ``iter`` after
    ``load_state_dict`` continues exactly there. The position is stored per rank but is the
    same on every rank, so any rank's state resumes a run, also at another ``dp_size``.
    """

    def __init__(
        self, num_samples: int, dp_rank: int, dp_size: int, seed: int, shuffle: bool = True
    ) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self._yielded = 0
        self._resume_at: int | None = None
        self._loaded_from: dict[str, Any] | None = None  # to report a given state only once

    @property
    def samples_per_rank(self) -> int:
        return self.num_samples // self.dp_size

    def __len__(self) -> int:
        return self.samples_per_rank

    def epoch_indices(self, epoch: int) -> torch.Tensor:
        """This rank's full index list for ``epoch``."""
        usable = self.samples_per_rank * self.dp_size
        if self.shuffle:
            generator = torch.Generator().manual_seed(epoch_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=generator)
        else:
            order = torch.arange(self.num_samples)
        return order[:usable][self.dp_rank :: self.dp_size]

    def __iter__(self) -> Iterator[int]:
        return EpochIterator(self)

    def _begin(self) -> tuple[int, int]:
        """Epoch and start position for an iterator drawing its first index.

        Decided at the first draw, not at ``iter``: DataLoader iterators call ``iter`` on
        their sampler more than once while setting up, and only the one that draws counts.
        """
        start = self._resume_at if self._resume_at is not None else 0
        self._resume_at = None
        self._yielded = start
        return self.epoch, start

    def _take_pending(self, epoch: int, position: int) -> bool:
        """A fixed permutation never changes mid-epoch (see EpochIterator)."""
        return False

    def _advance(self, epoch: int, position: int, exhausted: bool) -> None:
        """Called by the live iterator: record progress, or move to the next epoch."""
        if epoch != self.epoch:
            return  # a stale iterator of an earlier epoch; the current state wins
        if exhausted:
            self.epoch = epoch + 1
            self._yielded = 0
        else:
            self._yielded = position

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "yielded": self._yielded,
            "num_samples": self.num_samples,
            "dp_size": self.dp_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch and position; the next ``iter`` starts there.

        A state saved at another ``dp_size`` maps to the same global position in the epoch
        (exact when the global count divides by the new ``dp_size``). A state saved over
        other data, seed or order restarts its epoch, with a warning.
        """
        epoch, yielded = int(state["epoch"]), int(state["yielded"])
        report = state != self._loaded_from
        self._loaded_from = dict(state)
        saved = (state.get("num_samples"), state.get("seed"), state.get("shuffle"))
        if saved != (self.num_samples, self.seed, self.shuffle):
            if report:
                logger.warning(
                    "data sampler state was saved for (num_samples, seed, shuffle) = %s, this run "
                    "has %s: the data changed, so epoch %d restarts from its beginning",
                    saved,
                    (self.num_samples, self.seed, self.shuffle),
                    epoch,
                )
            yielded = 0
        saved_dp = int(state.get("dp_size", self.dp_size))
        if saved_dp != self.dp_size:
            consumed = yielded * saved_dp
            yielded = min(consumed // self.dp_size, self.samples_per_rank)
            if report:
                logger.info(
                    "data-parallel size changed from %d to %d: resuming after %d of epoch %d's "
                    "samples (%d per rank)",
                    saved_dp,
                    self.dp_size,
                    consumed,
                    epoch,
                    yielded,
                )
        self.epoch = epoch
        self._yielded = yielded
        self._resume_at = yielded


class EpochIterator(Iterator[int]):
    """One pass over a rank's shard of one epoch, from where the sampler stands.

    Shared by the samplers that keep their position this way (ShardedSampler,
    MixtureSampler). Before each draw it asks ``sampler._take_pending(epoch, position)``
    whether the epoch's index list changed (a mixture weight update) and re-plans if so.
    """

    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler
        self._epoch = 0
        self._position = 0
        self._indices: list[int] | None = None
        self._done = False

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> int:
        if self._done:
            raise StopIteration
        sampler = self._sampler
        if self._indices is None:
            self._epoch, self._position = sampler._begin()
        if sampler._take_pending(self._epoch, self._position) or self._indices is None:
            planned: list[int] = sampler.epoch_indices(self._epoch).tolist()
            self._indices = planned
        indices = self._indices
        if self._position >= len(indices):
            self._done = True
            self._sampler._advance(self._epoch, self._position, exhausted=True)
            raise StopIteration
        index = indices[self._position]
        self._position += 1
        self._sampler._advance(self._epoch, self._position, exhausted=False)
        return index
