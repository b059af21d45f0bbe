"""One attempt at a step, judged; with train.attribute_faults a faulty one is run once more to
tell bad data from a faulty machine.

The re-run uses the same weights (the optimizer has not stepped), the same micro-batches
(BatchStream replays them) and the same random state (restored), with the gradients zeroed;
an MoE model's router totals start over in the step body (begin_router_step), and its
expert biases only move after a good step. A fault that repeats is the data's: the windows
of the step are recorded as bad data and never read again. A fault that does not repeat is
the machine's: the clean re-run is the step, and after train.max_hardware_faults of them in
one launch the run stops with exit code 76. A good step costs nothing but keeping its
micro-batches and random state; a faulty one costs one more forward and backward and one
small collective.
"""

from __future__ import annotations

import functools
import math
import os
import socket

import torch
import torch.distributed as dist

from kempnerforge.checkpoint.rng import capture_rng_state, restore_rng_state
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import HardwareFaultError
from kempnerforge.core.logging import get_logger
from kempnerforge.data.bad_windows import write_bad_data
from kempnerforge.resilience.nan import LOSS_SPIKE, NaNDetector
from kempnerforge.training.session import BatchSource, StepResult, TrainingSession

logger = get_logger(__name__)

FAULT_HOSTS_ENV = "KEMPNERFORGE_FAULT_HOSTS_FILE"
"""When set, rank 0 appends the host of each suspected hardware fault to this file, one a
line, for a batch script to exclude (scripts/slurm/train.sbatch sets it)."""

_SHOWN_RANKS = 16


def attempt_step(session: TrainingSession, step: int) -> tuple[StepResult, bool]:
    """Run the step body for optimizer step ``step + 1`` and judge it; True when it is good.

    With train.attribute_faults a faulty attempt (non-finite, or a loss spike) is run once
    more on the same weights and batches and attributed (module docstring); the result
    returned is the re-run's. The verdict (nan_detector.check) counts a bad attempt toward
    the rollback streak and names the windows it read.
    """
    train = session.config.train
    describe = functools.partial(
        session.data.describe_last_read, _rows_per_step(train, session.batches.source)
    )
    if train.attribute_faults and session.replicas.replays_attempts:
        result, described = _attempt_with_rerun(session, step)
        if described is not None:
            describe = functools.partial(str, described)
    else:
        result = session.step_fn(session, step)
    good = session.nan_detector.check(
        result.loss, result.grad_norm, step + 1, data_position=describe
    )
    return result, good


def _rows_per_step(train: TrainConfig, source: BatchSource | None) -> int:
    """The positions of the data order each data-parallel rank reads in one step: a
    micro-batch's windows per micro-batch (a source's may be fewer: GRPO's are its
    prompts, the last ones read whichever step of their rollout this is)."""
    per_micro_batch = (
        train.batch_size if source is None else source.windows_per_micro_batch(train.batch_size)
    )
    return per_micro_batch * train.grad_accum_steps


def _attempt_with_rerun(session: TrainingSession, step: int) -> tuple[StepResult, str | None]:
    """The attempt, run again on a fault; also the description of the data it read, taken
    before a bad-data verdict makes those windows read as their stand-ins."""
    detector, stream = session.nan_detector, session.batches
    rng = capture_rng_state()
    stream.record_attempt()
    try:
        first = session.step_fn(session, step)
        fault = detector.fault_of(first.loss, first.grad_norm)
        if fault is None:
            return first, None
        bound = detector.spikes.bound()
        threshold = bound.threshold if bound else None
        evidence = [_local_evidence(detector, session.model, fault, threshold)]
        session.optimizer.zero_grad(set_to_none=True)
        restore_rng_state(rng)
        stream.replay_attempt()
        second = session.step_fn(session, step)
        repeat = detector.fault_of(second.loss, second.grad_norm)
        evidence.append(_local_evidence(detector, session.model, repeat, threshold))
        ranks, dp_ranks = _agree(session, evidence)
        if repeat is None:
            _record_hardware_fault(session, step + 1, fault, first, second, ranks[0])
            return second, None
        described = session.data.describe_last_read(
            _rows_per_step(session.config.train, session.batches.source)
        )
        _record_bad_data(session, step + 1, repeat, dp_ranks[1])
        return second, described
    finally:
        stream.end_attempt()


def _local_evidence(
    detector: NaNDetector, model: torch.nn.Module, fault: str | None, threshold: float | None
) -> int:
    """How strongly this rank's own numbers show ``fault``: 2 when its share of the loss
    (``detector.local_loss``) is non-finite (or, for a spike, above the threshold), 1 when
    only the gradients of ``model`` are non-finite (after the data-parallel reduction, which
    spreads them), 0 otherwise."""
    if fault is None:
        return 0
    local = detector.local_loss
    if local is not None:
        value = float(local)
        if fault == LOSS_SPIKE:
            if threshold is not None and value > threshold:
                return 2
        elif not math.isfinite(value):
            return 2
    return 1 if _local_grads_non_finite(model) else 0


def _local_grads_non_finite(model: torch.nn.Module) -> bool:
    """Whether any gradient this rank holds (its shard, for a sharded parameter) is not
    finite; one host read."""
    checks = []
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad  # type: ignore[union-attr]
        checks.append(torch.isfinite(local).all())
    return bool(checks) and not bool(torch.stack(checks).all())


def _agree(
    session: TrainingSession, evidence: list[int]
) -> tuple[list[list[int]], list[list[int]]]:
    """Every rank's evidence for each try, in one all-reduce over the world (a few bytes a
    rank, on a faulty step only): per try, the global ranks and the data-parallel ranks
    whose evidence is the strongest any rank showed (none when no rank showed any)."""
    runtime = session.runtime
    world, dp = runtime.world_size, runtime.dp_size
    table = torch.zeros(len(evidence), world + dp, device=runtime.device)
    for attempt, level in enumerate(evidence):
        table[attempt, runtime.rank] = level
        table[attempt, world + session.data.dp_rank] = level
    group = runtime.group("world")
    if group is not None:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
    rows = table.tolist()
    ranks, dp_ranks = [], []
    for row in rows:
        strongest = max(row)
        ranks.append([r for r in range(world) if strongest and row[r] == strongest])
        dp_ranks.append([r for r in range(dp) if strongest and row[world + r] == strongest])
    return ranks, dp_ranks


def _record_bad_data(session: TrainingSession, step: int, fault: str, dp_ranks: list[int]) -> None:
    """The fault repeated: record the step's windows (of the ranks whose own loss showed it,
    else of every rank) as bad data, skip them from the next batch on, log ``bad_data``."""
    data = session.data
    ranks = dp_ranks or list(range(data.dp_size))
    read = data.windows_last_read(
        _rows_per_step(session.config.train, session.batches.source), ranks
    )
    if read is None:
        logger.warning("step %d: the fault repeated, but the loader keeps no position", step)
        return
    epoch, windows = read
    new = data.add_bad_windows(windows)
    path = ""
    if new and session.runtime.rank == 0:
        path = write_bad_data(session.checkpointer.directory, new, step)
    session.batches.reset()  # the loader's workers pick the skip list up from a fresh start
    logger.warning(
        "step %d: the %s repeated when the step was run again on the same weights and "
        "batches: the data is the cause; %d window(s) of data-parallel rank(s) %s recorded "
        "as bad data and skipped from now on",
        step,
        fault.replace("_", " "),
        len(new),
        _shown(ranks),
    )
    session.tracker.log_event(
        step,
        "bad_data",
        reason=fault,
        epoch=epoch,
        dp_ranks=ranks[:_SHOWN_RANKS],
        windows=[[w.path, w.window] for w in windows],
        file=path or None,
    )


def _record_hardware_fault(
    session: TrainingSession,
    step: int,
    fault: str,
    first: StepResult,
    second: StepResult,
    ranks: list[int],
) -> None:
    """The fault did not repeat: name the host and rank it showed on, log
    ``suspected_hardware_fault``, and stop after train.max_hardware_faults of them."""
    detector: NaNDetector = session.nan_detector
    detector.hardware_faults += 1
    rank = ranks[0] if ranks else None
    host = _host_of(session, rank) if rank is not None else None
    if session.runtime.rank in ranks:
        logger.warning(
            "step %d: this rank (%d, host %s) showed a %s that did not repeat on a re-run",
            step,
            session.runtime.rank,
            socket.gethostname(),
            fault.replace("_", " "),
        )
    limit = session.config.train.max_hardware_faults
    logger.warning(
        "step %d: suspected hardware fault (%s, loss %s, grad norm %s; clean when run again: "
        "loss %s) on host %s, rank %s; the re-run's update is used (%d in this launch, limit %s)",
        step,
        fault.replace("_", " "),
        first.loss,
        first.grad_norm,
        second.loss,
        host or "unknown",
        _shown(ranks) if ranks else "unknown",
        detector.hardware_faults,
        limit or "none",
    )
    session.tracker.log_event(
        step,
        "suspected_hardware_fault",
        reason=fault,
        loss=first.loss,
        grad_norm=first.grad_norm,
        rerun_loss=second.loss,
        host=host,
        rank=rank,
        ranks=ranks[:_SHOWN_RANKS],
        count=detector.hardware_faults,
    )
    if session.runtime.rank == 0:
        _note_fault_host(host)
    if limit and detector.hardware_faults >= limit:
        where = f"host {host}, rank {rank}" if host else "an unnamed rank"
        raise HardwareFaultError(detector.hardware_faults, limit, step, where)


def _host_of(session: TrainingSession, rank: int) -> str:
    """The host name of global ``rank``, sent by it to every rank (faulty steps only)."""
    runtime = session.runtime
    name = socket.gethostname()
    group = runtime.group("world")
    if group is None:
        return name
    buffer = torch.zeros(256, dtype=torch.uint8, device=runtime.device)
    if runtime.rank == rank:
        encoded = name.encode("utf-8")[:256]
        buffer[: len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
    dist.broadcast(buffer, src=rank, group=group)
    return bytes(b for b in buffer.tolist() if b).decode("utf-8", "replace")


def _note_fault_host(host: str | None) -> None:
    """Append ``host`` to the file FAULT_HOSTS_ENV names, when both are given (rank 0's
    call: one line a fault)."""
    target = os.environ.get(FAULT_HOSTS_ENV)
    if not target or not host:
        return
    with open(target, "a", encoding="utf-8") as f:
        f.write(host + "\n")


def _shown(ranks: list[int]) -> str:
    more = f" and {len(ranks) - _SHOWN_RANKS} more" if len(ranks) > _SHOWN_RANKS else ""
    return ", ".join(map(str, ranks[:_SHOWN_RANKS])) + more
