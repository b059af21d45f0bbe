"""The replica groups' participation record: the window's share of whole quorums, the
steps a heal skipped, heals per hour, and the one-line warnings with their spacing."""

from __future__ import annotations

import pytest

from kempnerforge.config.fault_tolerance import FaultToleranceConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.training.replicas.participation import (
    HEALS_KEY,
    PARTICIPATION_KEY,
    Participation,
)


class Clock:
    """Seconds that the test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_share_counts_whole_quorums_over_the_last_window_of_steps():
    record = Participation(num_groups=3, window=4, warn_below=0)
    assert record.share() is None and record.row() == {}
    for participants in (3, 2, 3, 3):
        record.record(participants)
    assert record.share() == 3 / 4
    record.record(3)  # the first 3 leaves the window
    assert record.share() == 3 / 4
    record.record(3)  # the 2 leaves it
    assert record.share() == 1.0
    record.record(1)
    assert record.share() == 3 / 4


def test_steps_a_heal_skipped_count_as_without_this_group():
    record = Participation(num_groups=2, window=10, warn_below=0)
    for _ in range(4):
        record.record(2)
    record.healed(missed_steps=2)
    record.record(2)
    assert record.share() == 5 / 7


def test_heals_per_hour_counts_the_last_hour():
    clock = Clock()
    record = Participation(num_groups=2, window=10, warn_below=0, clock=clock)
    clock.now = 900.0  # a quarter of an hour in: one heal is four an hour
    record.healed(0)
    record.record(2)
    assert record.heals_per_hour() == pytest.approx(4.0)
    clock.now = 3600.0 + 899.0  # the heal is still within the last hour
    assert record.heals_per_hour() == pytest.approx(1.0)
    clock.now = 3600.0 + 901.0
    assert record.heals_per_hour() == 0.0
    assert record.row() == {PARTICIPATION_KEY: 1.0, HEALS_KEY: 0.0}


def test_the_warning_comes_once_below_and_once_back_never_per_step():
    record = Participation(num_groups=2, window=4, warn_below=0.75)
    lines = [record.record(p) for p in (1, 1, 1)]
    assert lines == [None, None, None]  # the window is not full yet
    assert record.record(1) is not None  # 0 of 4: below
    lines = [record.record(p) for p in (1, 1, 1, 1, 1, 1, 1, 1)]
    assert lines == [None] * 8  # still below: said once
    lines = [record.record(2) for _ in range(4)]
    assert lines[:2] == [None, None]  # 1 and 2 of 4 whole: still below
    assert lines[2] is not None and "again" in lines[2]  # 3 of 4: back at the threshold
    assert lines[3] is None


def test_a_share_hovering_at_the_threshold_logs_at_most_once_per_window():
    record = Participation(num_groups=2, window=4, warn_below=0.75)
    lines = [record.record(p) for p in (2, 2, 2, 1) + (2, 1) * 20]
    said = [i for i, line in enumerate(lines) if line is not None]
    assert said, lines  # it did fall below
    assert all(b - a >= 4 for a, b in zip(said, said[1:], strict=False)), said


def test_the_warning_names_the_field_and_what_to_do():
    record = Participation(num_groups=3, window=2, warn_below=0.9)
    record.record(2)
    line = record.record(2)
    assert line is not None
    assert "0% of the last 2 steps had all 3 replica groups" in line
    assert "fault_tolerance.participation_warn_below = 0.9" in line
    assert "--join-timeout-ms" in line


def test_zero_never_warns():
    record = Participation(num_groups=2, window=2, warn_below=0)
    assert [record.record(1) for _ in range(10)] == [None] * 10


@pytest.mark.parametrize(
    ("field", "value"),
    [("participation_window", 0), ("participation_warn_below", 1.5),
     ("participation_warn_below", -0.1)],
)  # fmt: skip
def test_the_participation_fields_are_checked(field, value):
    with pytest.raises(ConfigError, match=f"fault_tolerance.{field}"):
        FaultToleranceConfig(**{field: value})
