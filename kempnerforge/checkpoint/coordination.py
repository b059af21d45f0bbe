"""How the checkpoint manager's ranks agree: rank-0 steps, every-rank steps, verdicts.

The Coordinator's collectives run on the manager's process group (the default group when
None) and only on the main thread, in the same order on every rank as the training step's
own collectives. A background DCP write uses another group (the runtime's side group), so
the two never share a group from two threads.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kempnerforge.checkpoint.failures import FAILURES
from kempnerforge.core.errors import CheckpointError

_T = TypeVar("_T")


def new_gloo_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new gloo group over the ranks of `process_group` (the whole world when None).

    Collective over those ranks. Group ranks keep the order of `process_group`'s.
    """
    if process_group is None:
        group = dist.new_group(backend="gloo")
    else:
        ranks = dist.get_process_group_ranks(process_group)
        group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    assert isinstance(group, dist.ProcessGroup)
    return group


class Coordinator:
    """The manager's collectives: agreeing on failures and verdicts, rank-0-only steps.

    ``rank`` is the rank in ``process_group``. With world_size 1 every method runs locally.
    Each agreement costs one all-reduce of one integer; what went wrong travels (one
    broadcast from the failing rank) only when something did.
    """

    def __init__(
        self,
        directory: Path,
        *,
        rank: int,
        world_size: int,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        self.directory = directory
        self.rank = rank
        self.world_size = world_size
        self.group = process_group

    def first_failure(self, problems: list[str]) -> tuple[int, list[str]] | None:
        """The lowest rank whose `problems` are not empty, and those problems; None when
        every rank's are empty. Every rank gets the same answer. Collective."""
        if self.world_size == 1:
            return (self.rank, problems) if problems else None
        flag = torch.tensor(
            [self.rank if problems else self.world_size], dtype=torch.int64, device=self._device()
        )
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        failed = int(flag.item())
        if failed == self.world_size:
            return None
        shared: list[Any] = [problems if failed == self.rank else None]
        dist.broadcast_object_list(shared, group=self.group, group_src=failed)
        return failed, shared[0]

    def first_report(
        self, report: Any | None, *, firsthand: bool = False
    ) -> tuple[int, Any] | None:
        """The rank whose `report` (not None: something failed there) every rank takes, and
        that report; None when no rank has one. Collective: one all-reduce of an integer,
        and one broadcast from that rank only when some rank has a report.

        The lowest rank whose report is `firsthand` (it saw the failure itself, say the
        OS error of its own write) wins over ranks that only heard of it, then the lowest
        rank with any report.
        """
        if self.world_size == 1:
            return None if report is None else (self.rank, report)
        world = self.world_size
        priority = 2 * world if report is None else (self.rank if firsthand else world + self.rank)
        flag = torch.tensor([priority], dtype=torch.int64, device=self._device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        chosen = int(flag.item())
        if chosen == 2 * world:
            return None
        source = chosen % world
        shared: list[Any] = [report if source == self.rank else None]
        dist.broadcast_object_list(shared, group=self.group, group_src=source)
        return source, shared[0]

    def on_rank0(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on rank 0 only; every rank returns its result or raises its error."""
        if self.world_size == 1:
            return fn()
        outcome: list[Any] = [None]
        error: BaseException | None = None
        if self.rank == 0:
            try:
                outcome = [("ok", fn())]
            except FAILURES as e:
                error, outcome = e, [("error", str(e))]
        dist.broadcast_object_list(outcome, group=self.group, group_src=0)
        kind, value = outcome[0]
        if error is not None:
            raise error
        if kind == "error":
            raise CheckpointError(self.directory, f"rank 0 failed: {value}")
        return value

    def on_every_rank(self, fn: Callable[[], _T]) -> _T:
        """Run `fn` on every rank and return its result; if any rank fails, every rank raises.

        The failing rank raises its own error; the others a CheckpointError naming the
        lowest failing rank.
        """
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except FAILURES as e:
            error = e
        failure = self.first_failure([] if error is None else [str(error)])
        if error is not None:
            raise error
        if failure is not None:
            rank, messages = failure
            raise CheckpointError(self.directory, f"rank {rank} failed: {messages[0]}")
        return result

    def all_true(self, flag: bool) -> bool:
        """True when `flag` is true on every rank (one tiny all-reduce; local at world 1)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32, device=self._device())
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())

    def _device(self) -> torch.device:
        """Where a collective's tensor lives: this rank's GPU for an nccl group, else CPU."""
        if dist.get_backend(self.group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


@contextlib.contextmanager
def quiet_single_process(no_dist: bool) -> Iterator[None]:
    """Silence DCP's 'assuming ... single process' warning when `no_dist`: that is our intent."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=r".*assuming the intent is to .*")
        yield
