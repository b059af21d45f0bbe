"""Which windows each replica group reads in a step, so every window is read exactly once.

A job of replica groups has a fixed global batch: a step is ``num_slots`` slots
(fault_tolerance.num_replica_groups * train.grad_accum_steps), each slot one micro-batch of
every data-parallel rank of a group. Where a slot's windows sit in the epoch's order
depends only on the data step (how many steps' data has been consumed), the slot and the
rank in the group, never on which groups are alive; the groups of a step's quorum split the
slots among themselves (slot k goes to participant k % n). So a step taken by fewer groups
reads the same windows as one taken by all of them, and a discarded attempt reads nothing
that counts: the next attempt reads the same data step again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kempnerforge.core.errors import DataError


def assigned_slots(num_slots: int, participants: int, rank: int) -> list[int]:
    """The slots participant ``rank`` of ``participants`` reads: k with k % participants == rank.

    Over the participants these partition range(num_slots), and each gets at most one
    more slot than any other.
    """
    if participants < 1 or not 0 <= rank < participants:
        raise ValueError(f"participant rank {rank} of {participants} is out of range")
    return list(range(rank, num_slots, participants))


@dataclass(frozen=True)
class StepSlots:
    """The layout of one step's windows: ``num_slots`` slots of ``dp_size`` ranks x
    ``batch_size`` rows each, in epochs of ``positions_per_epoch`` positions.

    An epoch is truncated to whole steps, so every step lies inside one epoch; position
    p of epoch e is the window the data order puts there (a sampler's global_index).
    """

    num_slots: int
    dp_size: int
    batch_size: int
    positions_per_epoch: int

    @property
    def slot_rows(self) -> int:
        """Windows in one slot: every data-parallel rank's micro-batch."""
        return self.dp_size * self.batch_size

    @property
    def step_rows(self) -> int:
        """Windows in one step: the global batch."""
        return self.num_slots * self.slot_rows

    @property
    def steps_per_epoch(self) -> int:
        """Whole steps in an epoch (the rest of an epoch's positions is never read)."""
        return self.positions_per_epoch // self.step_rows

    def check(self, source: str) -> None:
        """A DataError naming ``source`` when an epoch holds no whole step."""
        if self.steps_per_epoch < 1:
            raise DataError(
                f"{source}: an epoch of {self.positions_per_epoch} windows holds no whole step "
                f"of {self.step_rows} windows ({self.num_slots} slots of {self.dp_size} ranks x "
                f"{self.batch_size}); prepare more data or lower train.batch_size, "
                "train.grad_accum_steps or fault_tolerance.num_replica_groups"
            )

    def epoch_and_step(self, data_step: int) -> tuple[int, int]:
        """The epoch of ``data_step`` (counted from the run's start) and its step in it."""
        return divmod(data_step, self.steps_per_epoch)

    def positions(self, step_in_epoch: int, slot: int, dp_rank: int) -> range:
        """The epoch positions rank ``dp_rank`` reads for ``slot`` of a step: ``batch_size``
        consecutive ones."""
        if not 0 <= slot < self.num_slots or not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"slot {slot} or rank {dp_rank} is out of range")
        start = step_in_epoch * self.step_rows + slot * self.slot_rows + dp_rank * self.batch_size
        return range(start, start + self.batch_size)

    def windows(
        self,
        data_step: int,
        slot: int,
        dp_rank: int,
        global_index: Callable[[int, int], int],
    ) -> list[int]:
        """The windows (dataset indices) of ``slot`` of ``data_step`` for rank ``dp_rank``,
        through the data order ``global_index(epoch, position)``: O(batch_size) work."""
        epoch, step = self.epoch_and_step(data_step)
        return [global_index(epoch, p) for p in self.positions(step, slot, dp_rank)]
