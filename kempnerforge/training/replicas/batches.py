"""A replica group's batches: the step slots its quorum assigned, read straight from the
dataset (and made into micro-batches by the stream's source, if it has one: GRPO samples
each slot's prompts), and the data position that only committed steps advance."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch.utils.data import default_collate

from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.data.sampling import StepSlots, assigned_slots
from kempnerforge.training.session import BatchSource, BatchStream


class SamplerPosition:
    """Stands in for the training loader of a replica group: its state is the sampler's.

    The loader is never iterated (reads are synchronous), and a loader's own state goes
    stale once a state was loaded into it; this one always reports the sampler's
    position, in the shape a loader state has (so any run can resume from it) and loads
    nothing of its own (DataPipeline.load_state_dict restores the sampler itself).
    """

    num_workers = 0

    def __init__(self, sampler: Any) -> None:
        self._sampler = sampler

    def state_dict(self) -> dict[str, Any]:
        return {"_sampler_iter_state": {"sampler_state": self._sampler.state_dict()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state  # the sampler holds the position, restored by load_loader_state


class ReplicaBatches(BatchStream):
    """BatchStream of a replica group: a step's micro-batches are its assigned slots.

    The data position lives in the pipeline's sampler (epoch, and the windows per rank of
    the epoch consumed), so checkpoints and the live state carry it as they carry any
    run's; here it counts whole steps: ``yielded`` is always a multiple of a step's
    windows per rank. Reads are synchronous, straight from the map-style dataset: which
    slots a group reads is known only once the step's quorum is, so nothing can be
    prefetched, and the loader (and its workers) is never started: ReplicaGroup.install
    puts a SamplerPosition in its place.
    """

    def __init__(
        self,
        pipeline: DataPipeline,
        num_slots: int,
        batch_size: int,
        source: BatchSource | None = None,
    ) -> None:
        super().__init__(pipeline)
        # A source makes each slot's micro-batch of fewer windows (GRPO: its prompts).
        self._slot_source = source
        if source is not None:
            batch_size = source.windows_per_micro_batch(batch_size)
        sampler, dataset = pipeline.sampler, pipeline.dataset
        if sampler is None or dataset is None:
            raise RuntimeError("replica groups need training data (the pipeline has none)")
        self.slots = StepSlots(
            num_slots=num_slots,
            dp_size=pipeline.dp_size,
            batch_size=batch_size,
            positions_per_epoch=sampler.samples_per_rank * sampler.dp_size,
        )
        self.slots.check(getattr(dataset, "path", "the training data"))
        self.assignment: list[int] = []
        """The slots of the step being attempted (set from its quorum by assign)."""

    @property
    def data_step(self) -> int:
        """Steps of data consumed since the run began: the committed attempts."""
        state = self._pipeline.sampler.state_dict()  # type: ignore[union-attr]
        per_rank_step = self.slots.step_rows // self.slots.dp_size
        return int(state["epoch"]) * self.slots.steps_per_epoch + (
            int(state["yielded"]) // per_rank_step
        )

    def assign(self, participants: int, rank: int) -> list[int]:
        """Take the slots of participant ``rank`` of ``participants`` for the next attempt."""
        self.assignment = assigned_slots(self.slots.num_slots, participants, rank)
        return self.assignment

    def step_batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        """The assigned slots' micro-batches of the current data step (``count``, the
        designed train.grad_accum_steps, is not used: the quorum decides how many)."""
        del count
        started = time.perf_counter()
        try:
            data_step = self.data_step
            return [self._read(data_step, slot) for slot in self.assignment]
        finally:
            self._wait_s += time.perf_counter() - started

    def _read(self, data_step: int, slot: int) -> dict[str, torch.Tensor]:
        pipeline = self._pipeline
        assert pipeline.sampler is not None and pipeline.dataset is not None
        windows = self.slots.windows(
            data_step, slot, pipeline.dp_rank, pipeline.sampler.global_index
        )
        batch = default_collate([pipeline.dataset[i] for i in windows])
        if self._slot_source is not None:
            return self._slot_source.micro_batch(batch, data_step)
        return batch

    def commit(self) -> int:
        """The attempt's step committed: move to the next data step; return the one consumed."""
        consumed = self.data_step
        epoch, step = self.slots.epoch_and_step(consumed + 1)
        sampler = self._pipeline.sampler
        assert sampler is not None
        state = sampler.state_dict()
        state.update(epoch=epoch, yielded=step * self.slots.step_rows // self.slots.dp_size)
        sampler.load_state_dict(state)
        return consumed

    def ensure_started(self) -> None:
        """Nothing to start: no loader iterator is used."""

    def reset(self) -> None:
        """Nothing to drop: no loader iterator is used."""
