"""ShardedSampler, a rank's share of a keyed per-epoch permutation, and the samplers' epoch
and position bookkeeping (BaseEpochSampler, EpochIterator, the data order's version)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import Sampler

from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.sampling.permutation import KeyedPermutation, derive_key

logger = get_logger(__name__)

ORDER_VERSION = 2
"""The data order the samplers compute, saved in their state: 2 is a keyed bijection of
the position per epoch; 1 (a state without ``order_version``) was a torch.randperm per
epoch, which this version no longer computes."""


def check_order_version(state: dict[str, Any], sampler: str) -> None:
    """Refuse a sampler state saved under another data order: it cannot continue exactly.

    Raises DataError, which the CLI prints as one line (exit code 2); the resume prefixes
    the checkpoint's path.
    """
    saved = int(state.get("order_version", 1))
    if saved == ORDER_VERSION:
        return
    age = "an older" if saved < ORDER_VERSION else "a newer"
    raise DataError(
        f"dataloader state ({sampler}, epoch {state.get('epoch')}, {state.get('yielded')} "
        f"samples per rank drawn): its data order was made by {age} version (order version "
        f"{saved}; this version computes order version {ORDER_VERSION}), so this run cannot "
        "continue its data exactly: start a new run (another train.name) from this "
        "checkpoint's weights with --checkpoint.resume_from=<this checkpoint> "
        "--checkpoint.load_weights_only=true"
    )


class BaseEpochSampler(Sampler[int]):
    """A rank's share of an epoch order that is computed position by position.

    A subclass gives ``global_index(epoch, position)``, the index at a position of all
    ranks' sequence; rank ``dp_rank`` reads positions ``dp_rank, dp_rank + dp_size, ...``
    of its first ``samples_per_rank * dp_size``. This class keeps the epoch and the
    position (``yielded``) that EpochIterator draws from and state_dict saves.
    """

    num_samples: int
    dp_rank: int
    dp_size: int

    def __init__(self, num_samples: int, dp_rank: int, dp_size: int) -> None:
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        self.num_samples = num_samples
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.epoch = 0
        self._yielded = 0
        self._resume_at: int | None = None

    @property
    def samples_per_rank(self) -> int:
        return self.num_samples // self.dp_size

    def __len__(self) -> int:
        return self.samples_per_rank

    def __iter__(self) -> Iterator[int]:
        return EpochIterator(self)

    def global_index(self, epoch: int, position: int) -> int:
        """The index at global ``position`` of ``epoch`` (all ranks' positions together)."""
        raise NotImplementedError

    def check_position(self, epoch: int, position: int) -> None:
        """Raise IndexError unless ``position`` is inside the part of ``epoch`` read."""
        if not 0 <= position < self.samples_per_rank * self.dp_size:
            raise IndexError(
                f"position {position} is outside epoch {epoch}'s "
                f"{self.samples_per_rank * self.dp_size} positions"
            )

    def rank_index(self, epoch: int, position: int) -> int:
        """This rank's ``position``-th index of ``epoch``."""
        return self.global_index(epoch, self.dp_rank + position * self.dp_size)

    def rank_indices(self, epoch: int, start: int, stop: int) -> list[int]:
        """This rank's indices ``start`` to ``stop - 1`` of ``epoch`` (clipped to the epoch)."""
        stop = min(stop, self.samples_per_rank)
        return [self.rank_index(epoch, p) for p in range(max(start, 0), stop)]

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
        """Apply a change of order that waits for the next draw; True if there was one."""
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


class ShardedSampler(BaseEpochSampler):
    """Sample indices for one data-parallel rank, epoch after epoch.

    Position p of epoch e is window ``perm(p)`` of a KeyedPermutation of
    ``range(num_samples)`` keyed by ``(seed, e)`` (identical on every rank, machine and
    ``dp_size``), or window p without shuffle. The epoch is its first ``samples_per_rank *
    dp_size`` positions, and rank r takes the positions ``r, r + dp_size, ...``. Ranks'
    shards are disjoint, equally long, and together form the truncated permutation. Each
    index is computed when drawn: O(1) memory and work per index, whatever the corpus.

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
        super().__init__(num_samples, dp_rank, dp_size)
        self.seed = seed
        self.shuffle = shuffle
        self._loaded_from: dict[str, Any] | None = None  # to report a given state only once
        self._permutation: tuple[int, KeyedPermutation] | None = None  # the last epoch's

    def permutation(self, epoch: int) -> KeyedPermutation:
        """The order of ``epoch``'s windows, the same for every rank and ``dp_size``."""
        cached = self._permutation
        if cached is None or cached[0] != epoch:
            key = derive_key("sampler", self.seed, epoch)
            cached = self._permutation = (epoch, KeyedPermutation(self.num_samples, key))
        return cached[1]

    def global_index(self, epoch: int, position: int) -> int:
        """The window at global ``position`` of ``epoch`` (all ranks' positions together)."""
        self.check_position(epoch, position)
        return self.permutation(epoch)(position) if self.shuffle else position

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "yielded": self._yielded,
            "num_samples": self.num_samples,
            "dp_size": self.dp_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "order_version": ORDER_VERSION,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch and position; the next ``iter`` starts there.

        A state saved at another ``dp_size`` maps to the same global position in the epoch
        (exact when the global count divides by the new ``dp_size``). A state saved over
        other data, seed or shuffle setting restarts its epoch, with a warning. One saved
        under another data order (``order_version``) is refused with a DataError.
        """
        check_order_version(state, "ShardedSampler")
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
    MixtureSampler). Each index is computed when drawn (``sampler.rank_index``); before
    each draw ``sampler._take_pending(epoch, position)`` may record a mixture weight change
    that applies from that position on.
    """

    def __init__(self, sampler: BaseEpochSampler) -> None:
        self._sampler = sampler
        self._epoch = 0
        self._position = 0
        self._started = False
        self._done = False

    def __iter__(self) -> EpochIterator:
        return self

    def __next__(self) -> int:
        if self._done:
            raise StopIteration
        sampler = self._sampler
        if not self._started:
            self._epoch, self._position = sampler._begin()
            self._started = True
        sampler._take_pending(self._epoch, self._position)
        if self._position >= sampler.samples_per_rank:
            self._done = True
            sampler._advance(self._epoch, self._position, exhausted=True)
            raise StopIteration
        index = sampler.rank_index(self._epoch, self._position)
        self._position += 1
        sampler._advance(self._epoch, self._position, exhausted=False)
        return index
