"""DataPipeline: the tokenizer, training loader and held-out data of one job as the loop reads
them (its batches, eval batches, position, mixture weights, bad windows); built in
pipeline_build.py.

Which windows positions of the data order read is a pure function of the sampler's order and
the datasets' skip lists, so any rank can name the windows of any rank's positions without
asking it; the position itself is read from the loader's own state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate

from kempnerforge.core.errors import DataError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.bad_windows import BadWindow, BadWindows
from kempnerforge.data.dataloader import TrainDataLoader, load_loader_state, sampler_state_of
from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset, SampleDataset
from kempnerforge.data.sampling import MixtureDataset, MixtureSampler, ShardedSampler
from kempnerforge.data.tokenizer import Tokenizer

logger = get_logger(__name__)

NO_TOKEN_EVAL_DATA = (
    "no held-out data configured: set data.eval_path to a prepare-data directory (or leave "
    "data.path empty to use the built-in corpus's held-out split)"
)
"""What a text job without eval data is told where eval data is needed."""
NO_IMAGE_TEXT_EVAL_DATA = (
    "no held-out image-text pairs: set vlm.eval_data to a jsonl index (or leave vlm.data "
    "empty to use the synthetic held-out set)"
)
"""What a vision-language job without eval data is told where eval data is needed."""

# Key of a not-yet-drawn mixture weight change in DataPipeline.state_dict().
PENDING_WEIGHTS_KEY = "pending_mixture_weights"
# Key of the bad windows (bad_windows.py) in DataPipeline.state_dict().
BAD_WINDOWS_KEY = "bad_windows"
_SHOWN_WINDOWS = 8
"""Windows of one source that describe_last_read names; the rest it counts."""


@dataclass
class DataPipeline:
    """Everything the training loop reads data from.

    ``dataloader`` is None when the job has no training data (an eval-only job); batches are
    dicts of int64 ``(batch, seq_len)`` tensors ``input_ids``, ``labels`` and ``doc_ids``.
    ``eval_datasets`` maps each held-out set's name to its data, in config order: the
    ``[[eval.sets]]`` tables, or the one set "heldout" when none are given.

    A ``[[data.datasets]]`` mixture reads a MixtureDataset through a MixtureSampler: its
    batches also carry ``dataset_idx`` (int64, ``(batch,)``), the source of each row, and
    ``dataset_names`` names the sources in that order (empty for a single dataset).

    ``bos_per_document`` says whether the training documents start with BOS (every source of
    a mixture), so a prompt given to the trained model can start the same way.

    A vision-language job's datasets are image-text pairs (build_image_text_pipeline): its
    batches hold ``pixel_values`` (float32, ``(batch, 3, S, S)``), ``input_ids`` and
    ``labels`` (int64, ``(batch, vlm.max_text_len)``), read the same stateful way.
    """

    dataset: MixtureDataset | SampleDataset | None
    sampler: ShardedSampler | MixtureSampler | None
    dataloader: TrainDataLoader | None
    tokenizer: Tokenizer
    eval_datasets: Mapping[str, SampleDataset] = field(default_factory=dict)
    dp_rank: int = 0
    dp_size: int = 1
    dataset_names: list[str] = field(default_factory=list)
    bos_per_document: bool = False
    bad_windows: BadWindows = field(default_factory=BadWindows)
    """Windows recorded as bad data: the training datasets read a stand-in for each."""
    prefix_len: int = 0
    """Positions the model puts before each batch's input_ids in its sequence (a joint
    decoder's image tokens): context parallelism splits that whole sequence."""
    batch_slice: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """This rank's part of each training and eval batch, set by the build under context
    parallelism (its slice of every sequence, after ``prefix_len``); None keeps batches
    whole."""
    eval_tasks: list[Any] = field(default_factory=list)
    """The job's downstream tasks (`[[eval.tasks]]`), loaded and packed into windows by the
    build (kempnerforge.evaluation.tasks.LoadedTask); empty without any."""

    def add_bad_windows(self, windows: list[BadWindow]) -> list[BadWindow]:
        """Skip ``windows`` from the next batch drawn on; return the ones not known before.

        Every source of the training data (token windows or image-text samples) gets the
        bad windows of its own path and window length; a window of another dataset, or of
        another window length, is kept, not applied. Like set_weights, the change reaches
        the loader's workers only through a fresh iterator (``BatchStream.reset()``), so a
        caller mid-run drops the iterator next.
        """
        new = self.bad_windows.add(windows)
        if new and self.dataset is not None:
            applied = 0
            for source in _sources_of(self.dataset):
                skip = self.bad_windows.of(source.path, _window_len(source))
                source.skip_windows = skip
                applied += len(skip)
            logger.info("skipping %d bad data window(s) of the training data", applied)
        return new

    def position(self) -> tuple[int, int] | None:
        """(epoch, positions read per rank in it): where the training loader stands in the
        data order; None when no loader keeps a position.

        Read from the loader's own state, exact also with worker processes, which prefetch
        ahead of the sampler; the same on every rank.
        """
        if self.dataloader is None or self.sampler is None or self.dataset is None:
            return None
        sampler_state = sampler_state_of(self.dataloader.state_dict())
        if not sampler_state:
            return None
        return int(sampler_state["epoch"]), int(sampler_state["yielded"])

    def windows_last_read(
        self, count: int, ranks: Iterable[int]
    ) -> tuple[int, list[BadWindow]] | None:
        """The epoch, and the windows data-parallel ``ranks`` read at their last ``count``
        positions (a training step's, for ``count`` its rows per rank; see windows_read);
        None when there is no position."""
        position = self.position()
        if position is None:
            return None
        epoch, end = position
        return epoch, self.windows_read(epoch, max(end - count, 0), end, ranks)

    def windows_read(
        self, epoch: int, start: int, stop: int, ranks: Iterable[int]
    ) -> list[BadWindow]:
        """The windows data-parallel ``ranks`` read at their positions ``start`` to ``stop -
        1`` of ``epoch``, rank by rank in draw order, as (path, window, window length); []
        without training data.

        A window recorded as bad appears as the stand-in read in its place. O(ranks x
        positions), each position computed in O(1).
        """
        dataset, sampler = self.dataset, self.sampler
        if dataset is None or sampler is None:
            return []
        positions = range(max(start, 0), min(stop, sampler.samples_per_rank))
        indices = [
            sampler.global_index(epoch, rank + position * sampler.dp_size)
            for rank in ranks
            for position in positions
        ]
        return [_window_of(dataset, index) for index in indices]

    def describe_last_read(self, count: int) -> str:
        """Where this rank's last ``count`` positions came from: epoch and dataset windows
        ("epoch 0: windows 3, 9 of <path>"); empty when there is no position.

        A window w of a prepared directory holds its tokens ``[w * seq_len, w * seq_len +
        seq_len]``; a window recorded as bad data shows as the stand-in read in its place.
        """
        read = self.windows_last_read(count, [self.dp_rank])
        if read is None:
            return ""
        epoch, reads = read
        names = {}
        if isinstance(self.dataset, MixtureDataset):
            sources = zip(self.dataset.names, self.dataset.datasets, strict=True)
            names = {source.path: f"{name} ({source.path})" for name, source in sources}
        by_source: dict[str, list[int]] = {}
        for window in reads:
            by_source.setdefault(names.get(window.path, window.path), []).append(window.window)
        parts = [f"windows {_shown(windows)} of {name}" for name, windows in by_source.items()]
        rank = f", rank {self.dp_rank}" if self.dp_size > 1 else ""
        return f"epoch {epoch}{rank}: " + "; ".join(parts)

    def set_weights(self, weights_by_name: dict[str, float]) -> None:
        """Change the mixture weights of the named sources; the others keep theirs.

        The new weights apply from the first batch drawn after the training loop drops its
        iterator (``BatchStream.reset()``, which must follow this call before the next batch
        is drawn): the loader then resumes at the exact consumed position, discarding what
        its workers prefetched under the old weights, and the sampler switches there. The
        change is part of the loader state, so a resumed run repeats it exactly.
        """
        if not isinstance(self.sampler, MixtureSampler):
            raise ValueError("set_weights needs a [[data.datasets]] mixture; this job has none")
        unknown = [name for name in weights_by_name if name not in self.dataset_names]
        if unknown:
            raise ValueError(
                f"unknown dataset {unknown[0]!r} in mixture weights; known datasets: "
                + ", ".join(self.dataset_names)
            )
        weights = self.sampler.weights
        for name, weight in weights_by_name.items():
            weight = float(weight)
            if not weight >= 0:
                raise ValueError(f"weight of dataset {name!r} must be >= 0, got {weight}")
            weights[self.dataset_names.index(name)] = weight
        if all(w == 0 for w in weights):
            raise ValueError(
                f"mixture weights {dict(zip(self.dataset_names, weights, strict=True))} are "
                "all 0 after the update; at least one dataset needs a weight > 0"
            )
        self.sampler.update_weights(weights)
        logger.info("mixture weights now %s", dict(zip(self.dataset_names, weights, strict=True)))

    @property
    def eval_dataset(self) -> SampleDataset | None:
        """The first held-out set, or None without eval data."""
        return next(iter(self.eval_datasets.values()), None)

    @property
    def num_train_windows(self) -> int:
        """Training windows in the whole dataset (all ranks); 0 without training data."""
        return len(self.dataset) if self.dataset is not None else 0

    @property
    def epoch(self) -> int:
        """The training epoch being read (0-based); 0 without training data."""
        return self.sampler.epoch if self.sampler is not None else 0

    def state_dict(self) -> dict[str, Any]:
        """The dataloader's position; the same on every data-parallel rank. {} without one.

        A mixture weight change made but not yet drawn with (a phase that fired at the step
        being saved) is kept beside the loader's state, which does not hold it, and so are
        the bad windows skipped (a copy of the checkpoint directory's bad_data.jsonl).
        """
        if self.dataloader is None:
            return {}
        # Read before the loader's state: building that may start an iterator whose prefetch
        # takes the change, while the snapshot it returns predates it.
        pending = self.sampler.pending_weights if isinstance(self.sampler, MixtureSampler) else None
        state = self.dataloader.state_dict()
        if pending is not None:
            state = {**state, PENDING_WEIGHTS_KEY: pending}
        if len(self.bad_windows):
            state = {**state, BAD_WINDOWS_KEY: self.bad_windows.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, also one saved with another worker count or dp size.

        Drop any live iterator afterwards: the next ``iter(dataloader)`` picks up there, and
        a saved pending weight change applies from its first draw, as it would have.
        """
        if self.dataloader is None or self.sampler is None or not state:
            return
        state = dict(state)
        pending = state.pop(PENDING_WEIGHTS_KEY, None)
        # Bad windows are only ever added: those this run already knows stay skipped.
        self.add_bad_windows(BadWindows().load_state_dict(state.pop(BAD_WINDOWS_KEY, [])))
        load_loader_state(self.dataloader, self.sampler, state)
        if pending is not None and isinstance(self.sampler, MixtureSampler):
            self.sampler.update_weights(pending)

    def eval_batches(
        self, num_steps: int, global_batch: int, name: str | None = None, *, max_rows: int = 0
    ) -> Iterator[dict[str, torch.Tensor]]:
        """This rank's share of the first ``num_steps * global_batch`` windows of held-out set
        ``name`` (None: the first set), the same on every call.

        Windows are read in order, wrapping around when the set is short. Eval step j covers
        windows ``[j * G, (j + 1) * G)`` for ``G = global_batch``; rank r of the ``dp_size``
        data-parallel ranks reads the r-th of ``dp_size`` contiguous slices of it, so the
        ranks together read exactly the windows one process would, whatever their number.
        A rank reads its slice in batches of at most ``max_rows`` rows (0: one batch).
        Slices differ by at most a row when ``dp_size`` does not divide G; a shorter slice
        gets a padding row, the step's first window with every label IGNORE_INDEX, so every
        rank runs the same forwards (a sharded model's collectives need that) and the
        padding counts no loss and no tokens.
        """
        if not self.eval_datasets:
            raise DataError(NO_TOKEN_EVAL_DATA)
        if name is None:
            name = next(iter(self.eval_datasets))
        if name not in self.eval_datasets:
            known = ", ".join(self.eval_datasets)
            raise KeyError(f"no eval set named {name!r} (sets: {known})")
        return self._eval_batches(self.eval_datasets[name], num_steps, global_batch, max_rows)

    def _eval_batches(
        self, dataset: SampleDataset, num_steps: int, global_batch: int, max_rows: int
    ) -> Iterator[dict[str, torch.Tensor]]:
        size, ranks = len(dataset), self.dp_size
        first = self.dp_rank * global_batch // ranks
        last = (self.dp_rank + 1) * global_batch // ranks
        rows = -(-global_batch // ranks)  # the longest slice: every rank reads this many
        per_batch = max_rows or rows
        for step in range(num_steps):
            base = step * global_batch
            for start in range(0, rows, per_batch):
                positions = range(first + start, first + min(start + per_batch, rows))
                yield default_collate([_eval_row(dataset, base, k, last, size) for k in positions])


def _eval_row(
    dataset: SampleDataset, base: int, position: int, last: int, size: int
) -> dict[str, torch.Tensor]:
    """Window ``base + position`` of the wrapped set, or past the slice's end (``last``) a
    padding row: window ``base`` with every label ignored."""
    if position < last:
        return dataset[(base + position) % size]
    row = dict(dataset[base % size])
    row["labels"] = torch.full_like(row["labels"], IGNORE_INDEX)
    return row


def _sources_of(dataset: MixtureDataset | SampleDataset) -> list[SampleDataset]:
    """The datasets windows are read from: a mixture's sources, or the dataset itself."""
    return list(dataset.datasets) if isinstance(dataset, MixtureDataset) else [dataset]


def _window_len(dataset: SampleDataset) -> int:
    """The tokens per window of a prepared directory; 0 for a dataset of entries."""
    return dataset.seq_len if isinstance(dataset, MemoryMappedDataset) else 0


def _window_of(dataset: MixtureDataset | SampleDataset, index: int) -> BadWindow:
    """The window sample ``index`` of ``dataset`` reads: its stand-in, for a bad one."""
    if isinstance(dataset, MixtureDataset):
        source, window = dataset.locate(index)
        return _window_of(dataset.datasets[source], window)
    return BadWindow(dataset.path, dataset.window_for(index), _window_len(dataset))


def _shown(windows: list[int]) -> str:
    """The first _SHOWN_WINDOWS of ``windows``, then how many more there are."""
    more = f" and {len(windows) - _SHOWN_WINDOWS} more" if len(windows) > _SHOWN_WINDOWS else ""
    return ", ".join(map(str, windows[:_SHOWN_WINDOWS])) + more
