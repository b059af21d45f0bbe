"""The objects the loop and its step bodies share: the session, the batch stream, a step's result.

They live apart from loop.py so that the modules the loop calls (eval, transitions, state, the
sample) can name the session without importing the loop; loop.py re-exports all three.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.checkpoint.memory_tier import MemoryTier
from kempnerforge.config.job import JobConfig
from kempnerforge.core.errors import DataError, unwrap_worker_error
from kempnerforge.core.logging import get_logger
from kempnerforge.data.dataloader import stop_workers
from kempnerforge.data.pipeline import DataPipeline
from kempnerforge.distributed.pipeline_parallel import PipelineBundle
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.metrics.tracker import MetricsTracker
from kempnerforge.resilience.nan import NaNDetector
from kempnerforge.resilience.shutdown import ShutdownHandler
from kempnerforge.training.hooks import HookRunner
from kempnerforge.training.phases import PhaseState

logger = get_logger(__name__)


class BatchSource(Protocol):
    """What makes a stream's micro-batches out of the loader's batches instead of handing
    those out (GRPO's rollouts: training/objectives/rollouts.py), with state of its own
    that a checkpoint keeps."""

    def next_batch(self, read: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The next micro-batch; ``read`` draws the loader's next batch (timed as a data
        wait)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def windows_per_micro_batch(self, batch_size: int) -> int:
        """How many of the data's windows one micro-batch of ``batch_size`` rows is made
        of (a GRPO micro-batch: batch_size / group_size prompts)."""
        ...

    def micro_batch(self, windows: dict[str, torch.Tensor], number: int) -> dict[str, torch.Tensor]:
        """The micro-batch made of ``windows`` alone, keyed by ``number`` (the data step):
        how replica groups, which read the slots their quorum assigned, use the source."""
        ...


class BatchStream:
    """The training dataloader plus its live iterator.

    Wraps the epoch-boundary restart and the "no dataloader configured" case so the step
    bodies don't each re-implement them. The loader is read off the pipeline on every
    access, so swapping pipeline.dataloader takes effect on the next step instead of
    leaving a stale snapshot.
    """

    def __init__(
        self,
        pipeline: DataPipeline,
        add_keys: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
        source: BatchSource | None = None,
    ) -> None:
        self._pipeline = pipeline
        self._add_keys = add_keys  # what an objective reads besides the data (a reference's)
        self._source = source  # what makes batches of the loader's (GRPO's rollouts)
        self._iterator: Iterator[dict[str, torch.Tensor]] | None = None
        self._iterator_loader: Any = None  # the loader the live iterator came from
        self._wait_s = 0.0  # seconds spent in next_batch since the last take_wait_s
        self._attempt: list[dict[str, torch.Tensor]] | None = None  # recorded micro-batches
        self._replay: list[dict[str, torch.Tensor]] | None = None  # still to be read again

    def record_attempt(self) -> None:
        """Keep the micro-batches the next step body reads, so replay_attempt can feed the
        same ones again (a faulty step run once more); they are held until end_attempt."""
        self._attempt, self._replay = [], None

    def replay_attempt(self) -> None:
        """Make the next step body read the recorded micro-batches again, in the same order,
        instead of drawing new ones: the data position does not move."""
        self._replay, self._attempt = list(self._attempt or []), []

    def end_attempt(self) -> None:
        """Stop recording and drop the recorded micro-batches."""
        self._attempt = self._replay = None

    def state_dict(self) -> dict[str, Any]:
        """What the stream holds beyond the data position (a checkpoint keeps it in each
        rank's train state): its source's state, nothing without one."""
        return {} if self._source is None else self._source.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take back what state_dict returned (after the data position is restored)."""
        if self._source is not None:
            self._source.load_state_dict(state)

    def take_wait_s(self) -> float:
        """Seconds next_batch has waited for batches since the last call (a step's data
        wait, for the tracker); resets the count."""
        wait, self._wait_s = self._wait_s, 0.0
        return wait

    @property
    def source(self) -> BatchSource | None:
        """What makes the micro-batches of the loader's batches, if anything does."""
        return self._source

    @property
    def dataloader(self) -> Any:
        return self._pipeline.dataloader

    @property
    def has_data(self) -> bool:
        return self.dataloader is not None

    def ensure_started(self) -> None:
        """Materialize the iterator, if it isn't already, for the loader in use.

        next_batch does this itself; the loop calls it up front so building an iterator
        (which spawns dataloader workers) stays outside the region MetricsTracker times.
        """
        loader = self.dataloader
        if loader is None:
            raise RuntimeError(
                "no training data is configured (the data pipeline has no dataloader); "
                "set data.path or leave it empty for the built-in corpus"
            )
        if self._iterator is None or self._iterator_loader is not loader:
            self._iterator = iter(loader)
            self._iterator_loader = loader

    def reset(self) -> None:
        """Drop the iterator, and stop its workers, so the next step takes a fresh one from
        the loader.

        A StatefulDataLoader re-applies its recorded skip, so this picks up inside the
        current epoch rather than restarting it.
        """
        loader = self.dataloader
        iterator = self._iterator
        if iterator is not None and hasattr(loader, "state_dict"):
            # Record the exact position (prefetched-but-unconsumed batches excluded) and
            # have the loader start its next iterator there.
            loader.load_state_dict(loader.state_dict())
        self._iterator = None
        self._iterator_loader = None
        if iterator is not None:
            stop_workers(iterator)

    def step_batches(self, count: int) -> list[dict[str, torch.Tensor]]:
        """The micro-batches of one step: the next ``count`` (train.grad_accum_steps).

        Replica groups (training/replicas/groups.py) read the slots the step's quorum
        assigned to their group instead, however many that is.
        """
        return [self.next_batch() for _ in range(count)]

    def next_batch(self) -> dict[str, torch.Tensor]:
        """The next micro-batch: a replayed one while replay_attempt's are left, else the
        loader's next; under context parallelism, this rank's slice of its sequences; with
        ``add_keys``, with the keys it adds (a preference objective's reference
        log-probabilities, training/objectives/reference.py)."""
        if self._replay is not None:
            if not self._replay:
                raise RuntimeError(
                    "the step body read more micro-batches when run again than on its first "
                    "try; a step body must read train.grad_accum_steps micro-batches a step"
                )
            batch = self._replay.pop(0)
        else:
            batch = self._timed_next_batch()
            if self._pipeline.batch_slice is not None:
                batch = self._pipeline.batch_slice(batch)
        if self._add_keys is not None:
            batch = self._add_keys(batch)
        if self._attempt is not None:
            self._attempt.append(batch)
        return batch

    def _timed_next_batch(self) -> dict[str, torch.Tensor]:
        if self._source is not None:
            return self._source.next_batch(self._timed_loader_batch)
        return self._timed_loader_batch()

    def _timed_loader_batch(self) -> dict[str, torch.Tensor]:
        started = time.perf_counter()
        try:
            return self._next_batch()
        except DataError as e:
            raise unwrap_worker_error(e) from None
        finally:
            self._wait_s += time.perf_counter() - started

    def _next_batch(self) -> dict[str, torch.Tensor]:
        self.ensure_started()
        assert self._iterator is not None
        try:
            return next(self._iterator)
        except StopIteration:
            # Epoch boundary: a new iterator starts the next epoch.
            self._iterator = iter(self._iterator_loader)
            try:
                return next(self._iterator)
            except StopIteration:
                raise RuntimeError(
                    "the training dataloader yields no batches: the dataset has fewer "
                    "windows than one batch per data-parallel rank"
                ) from None


class Replicas:
    """The replica groups a step's reductions span beyond this launch's own ranks.

    This base is the ordinary job, one launch, so it reduces nothing. Fault-tolerant
    replica groups (training/replicas/manager.py) sum over the groups of the step's quorum;
    the step bodies call the same methods either way.
    """

    num_groups: int = 1
    """Groups the global batch is designed for (fault_tolerance.num_replica_groups)."""
    replays_attempts: bool = True
    """Whether an attempt can be run again on the same batches (train.attribute_faults).
    A replica-group step commits its data with its quorum, so its re-run would read other
    slots under another quorum: there a faulty step is skipped at once."""

    def sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place over the replica groups (nothing with one group)."""

    def sum_gradients(self, model: torch.nn.Module) -> None:
        """Sum the gradients of ``model`` in place over the replica groups (nothing with one)."""

    def sum_router_totals(self, model: torch.nn.Module) -> None:
        """Sum the step totals of ``model``'s MoE routers (their expert loads) in place over
        the replica groups (nothing with one)."""

    def metrics_row(self) -> dict[str, float]:
        """Columns the groups add to a logged training row (how often they step together);
        none for one launch."""
        return {}


_ONE_LAUNCH = Replicas()


@dataclass
class StepResult:
    """What one training step reports back to the loop.

    The per-dataset fields stay empty for step bodies that don't produce them;
    text_tokens stays None, which a VLM run treats as an error rather than logging a zero.
    """

    loss: float
    grad_norm: float
    text_tokens: int | None = None
    dataset_token_counts: dict[str, int] = field(default_factory=dict)
    dataset_loss_sums: dict[str, float] = field(default_factory=dict)
    dataset_loss_counts: dict[str, int] = field(default_factory=dict)


@dataclass
class TrainingSession:
    """Everything one training run needs after the build phase.

    ``eval_dataloader`` is kept for code that constructs a session by the published
    fields, and is not read: eval draws the data pipeline's eval sets
    (``data.eval_batches``), whose windows eval.steps and the global eval batch fix in
    every layout and across a resume, which a loader handed in could not promise. A
    session given one says so once, when it is made.
    """

    config: JobConfig
    runtime: RuntimeContext
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    step_fn: Callable[[TrainingSession, int], StepResult]
    data: DataPipeline
    phases: PhaseState
    checkpointer: CheckpointManager
    tracker: MetricsTracker
    hooks: HookRunner
    nan_detector: NaNDetector
    shutdown_handler: ShutdownHandler
    pipeline: PipelineBundle | None = None
    eval_dataloader: Any | None = None
    profiler: Any | None = None

    def __post_init__(self) -> None:
        if self.eval_dataloader is not None:
            logger.warning(
                "TrainingSession.eval_dataloader is not read: eval uses the data pipeline's "
                "eval sets ([[eval.sets]], data.eval_path or the built-in held-out split)"
            )

    @property
    def batches(self) -> BatchStream:
        """The live batch iterator. Rebuilt if data is replaced wholesale."""
        stream = self.__dict__.get("_batches")
        if stream is None or stream._pipeline is not self.data:
            stream = BatchStream(self.data)
            self.__dict__["_batches"] = stream
        return stream

    @property
    def replicas(self) -> Replicas:
        """The replica groups the step's token count, loss and gradients are summed over:
        none beyond this launch unless use_replicas said otherwise."""
        return self.__dict__.get("_replicas") or _ONE_LAUNCH

    @property
    def objective_sums(self) -> list[torch.Tensor]:
        """This rank's sums of the objective's own metrics, one per micro-batch of the
        step (on the device, not yet reduced over ranks): the step body appends, the loop
        takes them on log steps (training/objectives/objective.py objective_metrics_row)."""
        return self.__dict__.setdefault("_objective_sums", [])

    @property
    def memory_tier(self) -> MemoryTier | None:
        """This rank's copies in host memory (checkpoint.memory_interval > 0), or None."""
        return self.__dict__.get("_memory_tier")

    def use_memory_tier(self, tier: MemoryTier) -> None:
        """Copy the state to ``tier`` on checkpoint.memory_interval's steps from now on."""
        self.__dict__["_memory_tier"] = tier

    def use_replicas(self, replicas: Replicas) -> None:
        """Sum the steps' reductions over ``replicas`` from now on."""
        self.__dict__["_replicas"] = replicas

    def use_batches(self, stream: BatchStream) -> None:
        """Read the steps' batches from ``stream`` (over this session's data) from now on."""
        if stream._pipeline is not self.data:
            raise ValueError("the batch stream must read this session's data pipeline")
        self.__dict__["_batches"] = stream
