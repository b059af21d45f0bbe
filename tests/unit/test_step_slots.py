"""Step slots of replica groups: every window of every step read once, whoever is alive."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kempnerforge.core.errors import DataError
from kempnerforge.data.sampling.sampler import ShardedSampler
from kempnerforge.data.sampling.step_slots import StepSlots, assigned_slots


@pytest.mark.parametrize("num_slots", [1, 2, 5, 8])
def test_assigned_slots_partition_the_step_for_any_participant_count(num_slots):
    for participants in range(1, num_slots + 1):
        taken = [assigned_slots(num_slots, participants, p) for p in range(participants)]
        flat = [k for slots in taken for k in slots]
        assert sorted(flat) == list(range(num_slots))
        assert max(map(len, taken)) - min(map(len, taken)) <= 1


def test_assigned_slots_refuses_a_rank_outside_the_quorum():
    with pytest.raises(ValueError, match="out of range"):
        assigned_slots(4, 2, 2)


def _read_run(slots: StepSlots, sampler: ShardedSampler, quorums: list[int]) -> Counter:
    """The windows a run reads when data step d is committed by quorums[d] participants
    (each reading its assigned slots on every data-parallel rank)."""
    read: Counter = Counter()
    for data_step, n in enumerate(quorums):
        for p in range(n):
            for k in assigned_slots(slots.num_slots, n, p):
                for r in range(slots.dp_size):
                    read.update(slots.windows(data_step, k, r, sampler.global_index))
    return read


@pytest.mark.parametrize("dp_size", [1, 2])
def test_any_sequence_of_quorums_reads_the_uninterrupted_runs_windows_once_each(dp_size):
    sampler = ShardedSampler(997, 0, dp_size, seed=3)
    slots = StepSlots(
        num_slots=4,
        dp_size=dp_size,
        batch_size=3,
        positions_per_epoch=sampler.samples_per_rank * dp_size,
    )
    steps = slots.steps_per_epoch  # one whole epoch: every window of it exactly once
    rng = random.Random(0)
    uninterrupted = _read_run(slots, sampler, [2] * steps)
    for _ in range(5):
        quorums = [rng.randint(1, 4) for _ in range(steps)]
        assert _read_run(slots, sampler, quorums) == uninterrupted
    assert set(uninterrupted.values()) == {1}
    assert len(uninterrupted) == steps * slots.step_rows


def test_epochs_are_truncated_to_whole_steps_and_reshuffled():
    sampler = ShardedSampler(50, 0, 1, seed=1)
    slots = StepSlots(num_slots=2, dp_size=1, batch_size=4, positions_per_epoch=50)
    assert slots.steps_per_epoch == 6  # 48 of the 50 windows; 2 are never read
    last = slots.windows(5, 1, 0, sampler.global_index)
    first_of_next = slots.windows(6, 0, 0, sampler.global_index)
    assert last == [sampler.global_index(0, p) for p in range(44, 48)]
    assert first_of_next == [sampler.global_index(1, p) for p in range(4)]


def test_an_epoch_without_a_whole_step_is_a_data_error_naming_the_source():
    slots = StepSlots(num_slots=8, dp_size=2, batch_size=4, positions_per_epoch=60)
    with pytest.raises(DataError, match="data/tiny: an epoch of 60 windows holds no whole step"):
        slots.check("data/tiny")
