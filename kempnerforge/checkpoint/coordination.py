"""How the checkpoint manager's ranks agree: a gloo group of its own, rank-0 steps, failures."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kempnerforge.checkpoint.errors import CheckpointError
from kempnerforge.checkpoint.failures import FAILURES

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
    """The manager's own collectives (agreeing on failure, rank-0-only steps, polling).

    They run on a gloo group created here once and used for nothing else: a background
    DCP write runs collectives from another thread, and two threads issuing collectives
    on one group can interleave differently on different ranks and hang. With
    world_size 1 every method runs locally and no group exists.
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
        self.group = new_gloo_group(process_group) if world_size > 1 else None

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

        The failing rank raises its own error; the others a CheckpointError naming it.
        """
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except FAILURES as e:
            error = e
        if self.world_size > 1:
            errors: list[Any] = [None] * self.world_size
            dist.all_gather_object(errors, None if error is None else str(error), self.group)
            failed = [(r, e) for r, e in enumerate(errors) if e is not None]
            if failed and error is None:
                rank, message = failed[0]
                raise CheckpointError(self.directory, f"rank {rank} failed: {message}")
        if error is not None:
            raise error
        return result

    def all_true(self, flag: bool) -> bool:
        """True when `flag` is true on every rank (one tiny all-reduce; local at world 1)."""
        if self.world_size == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int32)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group)
        return bool(value.item())


@contextlib.contextmanager
def quiet_single_process(no_dist: bool) -> Iterator[None]:
    """Silence DCP's 'assuming ... single process' warning when `no_dist`: that is our intent."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=r".*assuming the intent is to .*")
        yield
