"""MixtureDataset and MixtureSampler: several prepared datasets drawn by weight."""

from __future__ import annotations

import bisect
import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from kempnerforge.core.logging import get_logger
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.sampling.mixture_order import MixtureOrder
from kempnerforge.data.sampling.sampler import ORDER_VERSION, BaseEpochSampler, check_order_version

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

    def __getitems__(self, indices: list[int]) -> list[dict[str, torch.Tensor]]:
        """The samples of ``indices``, each source's windows fetched together first
        (MemoryMappedDataset.prefetch); the same samples as one ``self[i]`` each."""
        by_source: dict[int, list[int]] = {}
        for index in indices:
            source, window = self.locate(index)
            by_source.setdefault(source, []).append(window)
        for source, windows in by_source.items():
            self.datasets[source].prefetch(windows)
        return [self[i] for i in indices]


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


_Plan = tuple[int, list[tuple[int, tuple[float, ...]]]]
"""An epoch and its (global position, weights) segments: what a MixtureOrder is built from."""


class MixtureSampler(BaseEpochSampler):
    """Global indices into a MixtureDataset for one data-parallel rank, epoch after epoch.

    An epoch is ``sum(sizes)`` positions, of which the first ``samples_per_rank *
    dp_size`` are read; rank r takes positions ``r, r + dp_size, ...``. Each source gets
    its exact share of the positions (the epoch length times its mixture probability,
    rounded by largest remainder), and of every chunk of them, at places a keyed
    permutation of the chunk picks; it reads its windows pass after pass of a fresh keyed
    permutation of the source, each window once per pass, afresh every epoch (see
    MixtureOrder). Any position's index is computed in O(1) from ``(seed, epoch)``, the
    weights and their changes, so every rank and every ``dp_size`` gets the same global
    sequence and nothing of the epoch's size is ever built.

    ``update_weights`` takes effect at this sampler's next draw: the rest of the epoch is a
    new segment with the new probabilities, keyed by ``(seed, epoch, global position)``,
    and each source's passes continue without reading a window twice. The epoch is thus a
    function of its starting weights and its list of changes, which the state holds along
    with the epoch and position. The next epoch starts with the latest weights. Resume
    through a StatefulDataLoader works like ShardedSampler's.
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
        super().__init__(sum(sizes), dp_rank, dp_size)
        mixture_probabilities(weights, temperature)  # validates
        self.sizes = list(sizes)
        self.temperature = float(temperature)
        self.seed = seed
        self.configured_weights = [float(w) for w in weights]
        self._epoch_weights = list(self.configured_weights)  # weights at this epoch's start
        self._changes: list[tuple[int, list[float]]] = []  # (global position, weights)
        self._pending: list[float] | None = None
        self._loaded_from: dict[str, Any] | None = None
        self._order: tuple[_Plan, MixtureOrder] | None = None  # the last order built

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

    def order(self, epoch: int | None = None) -> MixtureOrder:
        """The order of ``epoch`` (the current one by default) as it stands.

        The current epoch has its start weights and changes; a later one would start with
        the weights in use now.
        """
        if epoch is None or epoch == self.epoch:
            epoch, segments = self.epoch, [(0, self._epoch_weights), *self._changes]
        else:
            segments = [(0, self.weights)]
        plan: _Plan = (epoch, [(pos, tuple(w)) for pos, w in segments])
        cached = self._order
        if cached is None or cached[0] != plan:
            probabilities = [
                (pos, mixture_probabilities(w, self.temperature)) for pos, w in segments
            ]
            order = MixtureOrder(self.sizes, self.seed, epoch, probabilities)
            cached = self._order = (plan, order)
        return cached[1]

    def global_index(self, epoch: int, position: int) -> int:
        """The MixtureDataset index at global ``position`` of ``epoch`` (all ranks')."""
        self.check_position(epoch, position)
        return self.order(epoch).global_index(position)

    def _take_pending(self, epoch: int, position: int) -> bool:
        """Record a pending weight change at this rank's ``position``; True if one was.

        Stored at the global position ``position * dp_size``: every rank has read the
        positions before it and none after, so all ranks switch at the same place.
        """
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
            "order_version": ORDER_VERSION,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at the saved epoch, position and weights; the next ``iter`` starts there.

        A pending ``update_weights`` survives this and applies at the first draw after it.
        A state saved over other sources, weights, temperature or seed restarts its epoch
        with this run's configured weights, with a warning. One saved under another data
        order (``order_version``) is refused with a DataError.
        """
        check_order_version(state, "MixtureSampler")
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
