"""Which dataset windows positions of the data order read, and where bad windows are skipped.

Both are pure functions of the sampler's order and the datasets' skip lists, so any rank can
name the windows of any rank's positions without asking it.
"""

from __future__ import annotations

from collections.abc import Iterable

from kempnerforge.data.bad_windows import BadWindow, BadWindows
from kempnerforge.data.dataset import MemoryMappedDataset, SampleDataset
from kempnerforge.data.mixture import MixtureDataset, MixtureSampler
from kempnerforge.data.sampler import ShardedSampler


def sources_of(dataset: MixtureDataset | SampleDataset) -> list[SampleDataset]:
    """The datasets windows are read from: a mixture's sources, or the dataset itself."""
    return list(dataset.datasets) if isinstance(dataset, MixtureDataset) else [dataset]


def window_len(dataset: SampleDataset) -> int:
    """The tokens per window of a prepared directory; 0 for a dataset of entries."""
    return dataset.seq_len if isinstance(dataset, MemoryMappedDataset) else 0


def apply_bad_windows(dataset: MixtureDataset | SampleDataset, bad: BadWindows) -> int:
    """Give every source of ``dataset`` (token windows or image-text samples) its bad
    windows; return how many of ``bad`` apply to this data (a window of another dataset, or
    of another window length, is kept, not applied)."""
    applied = 0
    for source in sources_of(dataset):
        skip = bad.of(source.path, window_len(source))
        source.skip_windows = skip
        applied += len(skip)
    return applied


def windows_read(
    dataset: MixtureDataset | SampleDataset,
    sampler: ShardedSampler | MixtureSampler,
    epoch: int,
    start: int,
    stop: int,
    ranks: Iterable[int],
) -> list[BadWindow]:
    """The windows that positions ``start`` to ``stop - 1`` of ``epoch`` of each rank in
    ``ranks`` read, rank by rank in draw order, as (path, window, window length).

    A window recorded as bad appears as the stand-in read in its place. O(ranks x
    positions), each position computed in O(1).
    """
    stop = min(stop, sampler.samples_per_rank)
    read = []
    for rank in ranks:
        for position in range(max(start, 0), stop):
            index = sampler.global_index(epoch, rank + position * sampler.dp_size)
            read.append(_window_of(dataset, index))
    return read


def _window_of(dataset: MixtureDataset | SampleDataset, index: int) -> BadWindow:
    if isinstance(dataset, MixtureDataset):
        source, window = dataset.locate(index)
        return _window_of(dataset.datasets[source], window)
    return BadWindow(dataset.path, dataset.window_for(index), window_len(dataset))
