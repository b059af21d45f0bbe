"""MixtureDataset and MixtureSampler: several prepared datasets drawn by weight."""

from __future__ import annotations

import bisect
import copy
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.sampler import EpochIterator
from kempnerforge.metrics.logging import get_logger

logger = get_logger(__name__)


class MixtureDataset(Dataset[dict[str, torch.Tensor]]):
    """The concatenation of several datasets' index spaces, each sample tagged by its source.

    Global index ``offsets[i] + j`` is window ``j`` of ``datasets[i]``. A sample is the
    source's dict plus ``dataset_idx``, an int64 scalar tensor ``i``, so a collated batch
    carries ``dataset_idx`` of shape ``(batch,)``.
    """

    def __init__(self, datasets: list[MemoryMappedDataset], names: list[str]) -> None:
        if not datasets or len(datasets) != len(names):
            raise ValueError(
                f"need one name per dataset and at least one dataset, got {len(datasets)} "
                f"datasets and {len(names)} names"
            )
        self.datasets = datasets
        self.names = names
        self.sizes = [len(d) for d in datasets]
        self.offsets = [0]
        for size in self.sizes:
            self.offsets.append(self.offsets[-1] + size)

    @property
    def num_tokens(self) -> int:
        return sum(d.num_tokens for d in self.datasets)

    def __len__(self) -> int:
        return self.offsets[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """(source, window in that source) of global index ``index``."""
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range [0, {len(self)})")
        source = bisect.bisect_right(self.offsets, index) - 1
        return source, index - self.offsets[source]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        source, window = self.locate(index)
        sample = dict(self.datasets[source][window])
        sample["dataset_idx"] = torch.tensor(source, dtype=torch.int64)
        return sample


def mixture_probabilities(weights: Sequence[float], temperature: float) -> list[float]:
    """p_i proportional to w_i ** (1 / temperature); a zero weight stays zero."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if any(not w >= 0 for w in weights):
        raise ValueError(f"weights must be >= 0, got {list(weights)}")
    scaled = [float(w) ** (1.0 / temperature) if w > 0 else 0.0 for w in weights]
    total = sum(scaled)
    if total <= 0:
        raise ValueError(f"at least one weight must be > 0, got {list(weights)}")
    return [s / total for s in scaled]


def _seed(*parts: object) -> int:
    """A generator seed for a tuple of ints; distinct tuples never share one."""
    text = "kempnerforge-mixture:" + ":".join(map(str, parts))
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class MixtureSampler(Sampler[int]):
    """Global indices into a MixtureDataset for one data-parallel rank, epoch after epoch.

    An epoch is ``sum(sizes)`` positions, rounded down to a multiple of ``dp_size``. Each
    position draws a source with the mixture probabilities, then that source's next window
    from a seeded permutation of it (cycling, with a new permutation each pass; the
    per-source cursors start afresh every epoch). Everything is seeded from ``(seed,
    epoch)``, so every rank computes the same global sequence; rank r takes positions
    ``r::dp_size``.

    ``update_weights`` takes effect at this sampler's next draw: the rest of the epoch's
    sources are drawn again from a seed derived from ``(seed, epoch, global position)``
    with the new probabilities. The epoch is thus a function of its starting weights and
    its list of changes, which the state holds along with the epoch and position (the
    per-source cursors follow from those). The next epoch starts with the latest weights.
    Resume through a StatefulDataLoader works like ShardedSampler's.
    """

    def __init__(
        self,
        sizes: list[int],
        weights: list[float],
        temperature: float,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        if not sizes or len(sizes) != len(weights):
            raise ValueError(f"need one weight per source, got {len(sizes)} and {len(weights)}")
        if any(size < 1 for size in sizes):
            raise ValueError(f"every source needs at least one window, got sizes {sizes}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, {dp_size}), got {dp_rank}")
        mixture_probabilities(weights, temperature)  # validates
        self.sizes = list(sizes)
        self.temperature = float(temperature)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.configured_weights = [float(w) for w in weights]
        self.epoch = 0
        self._yielded = 0
        self._epoch_weights = list(self.configured_weights)  # weights at this epoch's start
        self._changes: list[tuple[int, list[float]]] = []  # (global position, weights)
        self._pending: list[float] | None = None
        self._resume_at: int | None = None
        self._loaded_from: dict[str, Any] | None = None

    @property
    def num_samples(self) -> int:
        return sum(self.sizes)

    @property
    def samples_per_rank(self) -> int:
        return self.num_samples // self.dp_size

    def __len__(self) -> int:
        return self.samples_per_rank

    @property
    def weights(self) -> list[float]:
        """The weights in use now (a pending update included)."""
        if self._pending is not None:
            return list(self._pending)
        return list(self._changes[-1][1] if self._changes else self._epoch_weights)

    @property
    def pending_weights(self) -> list[float] | None:
        """Weights given to ``update_weights`` that no draw has used yet; None if none are."""
        return list(self._pending) if self._pending is not None else None

    @property
    def probabilities(self) -> list[float]:
        return mixture_probabilities(self.weights, self.temperature)

    def update_weights(self, weights: Sequence[float]) -> None:
        """New weights for the positions not yet drawn, from this sampler's next draw."""
        if len(weights) != len(self.sizes):
            raise ValueError(f"need {len(self.sizes)} weights, got {len(weights)}")
        mixture_probabilities(weights, self.temperature)  # validates
        self._pending = [float(w) for w in weights]

    def global_sequence(
        self, epoch: int, epoch_weights: list[float], changes: list[tuple[int, list[float]]]
    ) -> torch.Tensor:
        """All ranks' global indices of ``epoch``, given its start weights and changes."""
        length = self.samples_per_rank * self.dp_size
        sources = torch.empty(length, dtype=torch.int64)
        segments = [(0, epoch_weights, _seed(self.seed, epoch))]
        segments += [(pos, w, _seed(self.seed, epoch, pos)) for pos, w in changes]
        for k, (start, weights, seed) in enumerate(segments):
            end = segments[k + 1][0] if k + 1 < len(segments) else length
            if end <= start:
                continue
            probs = torch.tensor(
                mixture_probabilities(weights, self.temperature), dtype=torch.float64
            )
            generator = torch.Generator().manual_seed(seed)
            sources[start:end] = torch.multinomial(probs, end - start, True, generator=generator)
        indices = torch.empty(length, dtype=torch.int64)
        offset = 0
        for i, size in enumerate(self.sizes):
            where = (sources == i).nonzero().flatten()
            count = len(where)
            if count:
                passes = -(-count // size)
                order = [
                    torch.randperm(
                        size,
                        generator=torch.Generator().manual_seed(
                            _seed(self.seed, epoch, "source", i, p)
                        ),
                    )
                    for p in range(passes)
                ]
                indices[where] = torch.cat(order)[:count] + offset
            offset += size
        return indices

    def epoch_indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's index list for ``epoch`` (the current one by default) as it stands."""
        if epoch is None or epoch == self.epoch:
            sequence = self.global_sequence(self.epoch, self._epoch_weights, self._changes)
        else:
            sequence = self.global_sequence(epoch, self.weights, [])
        return sequence[self.dp_rank :: self.dp_size]

    def __iter__(self) -> Iterator[int]:
        return EpochIterator(self)

    def _begin(self) -> tuple[int, int]:
        """Epoch and start position for an iterator drawing its first index."""
        start = self._resume_at if self._resume_at is not None else 0
        self._resume_at = None
        self._yielded = start
        return self.epoch, start

    def _take_pending(self, epoch: int, position: int) -> bool:
        """Record a pending weight change at ``position`` of this rank; True if one was."""
        if self._pending is None or epoch != self.epoch:
            return False
        at = position * self.dp_size
        changes = [c for c in self._changes if c[0] < at]
        self._changes = [*changes, (at, self._pending)]
        self._pending = None
        return True

    def _advance(self, epoch: int, position: int, exhausted: bool) -> None:
        if epoch != self.epoch:
            return
        if exhausted:
            # The next epoch starts with the latest weights; a pending update stays pending.
            self._epoch_weights = list(
                self._changes[-1][1] if self._changes else self._epoch_weights
            )
            self.epoch = epoch + 1
            self._yielded = 0
            self._changes = []
        else:
            self._yielded = position

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "yielded": self._yielded,
            "weights": list(self._changes[-1][1] if self._changes else self._epoch_weights),
            "epoch_weights": list(self._epoch_weights),
            "changes": [[pos, list(w)] for pos, w in self._changes],
            "sizes": list(self.sizes),
            "configured_weights": list(self.configured_weights),
            "temperature": self.temperature,
            "dp_size": self.dp_size,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch, position and weights; the next ``iter`` starts there.

        A pending ``update_weights`` survives this and applies at the first draw after it.
        A state saved over other sources, weights, temperature or seed restarts its epoch
        with this run's configured weights, with a warning.
        """
        state = copy.deepcopy(state)
        epoch, yielded = int(state["epoch"]), int(state["yielded"])
        report = state != self._loaded_from
        self._loaded_from = copy.deepcopy(state)
        saved = (
            state.get("sizes"),
            state.get("configured_weights"),
            state.get("temperature"),
            state.get("seed"),
        )
        mine = (self.sizes, self.configured_weights, self.temperature, self.seed)
        if saved != mine:
            if report:
                logger.warning(
                    "mixture sampler state was saved for (sizes, weights, temperature, seed) = "
                    "%s, this run has %s: epoch %d restarts from its beginning",
                    saved,
                    mine,
                    epoch,
                )
            self.epoch, self._yielded, self._resume_at = epoch, 0, 0
            self._epoch_weights, self._changes = list(self.configured_weights), []
            return
        saved_dp = int(state.get("dp_size", self.dp_size))
        if saved_dp != self.dp_size:
            yielded = min(yielded * saved_dp // self.dp_size, self.samples_per_rank)
        self.epoch = epoch
        self._yielded = yielded
        self._resume_at = yielded
        self._epoch_weights = [float(w) for w in state["epoch_weights"]]
        self._changes = [(int(pos), [float(x) for x in w]) for pos, w in state["changes"]]
