"""The hang watchdog's limits: derived from measured times, per kind, nested work apart.

The watchdog firing (stacks, exit 77 on every rank) is tested end to end in
tests/e2e/test_hang.py; here the clock is a counter the test advances, and no thread runs.
"""

from __future__ import annotations

import pytest

from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.resilience import hang
from kempnerforge.resilience.hang import CHECKPOINT, EVAL, FLOOR_S, START_S, STEP, HangWatchdog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(hang.time, "monotonic", clock)
    return clock


def _run(watchdog: HangWatchdog, clock: Clock, kind: str, seconds: float, step: int = 1) -> None:
    with watchdog.watch(kind, step):
        clock.now += seconds


def test_the_first_two_of_a_kind_get_the_start_up_allowance_then_ten_times_the_slowest(
    tmp_path, clock
):
    watchdog = HangWatchdog(0, tmp_path)
    assert watchdog.limit_s(STEP) == START_S
    _run(watchdog, clock, STEP, 900.0)  # compile: not counted
    assert watchdog.limit_s(STEP) == START_S
    _run(watchdog, clock, STEP, 40.0)
    assert watchdog.limit_s(STEP) == 400.0
    _run(watchdog, clock, STEP, 60.0)
    _run(watchdog, clock, STEP, 10.0)
    assert watchdog.limit_s(STEP) == 600.0  # the slowest counted, not the last
    assert watchdog.limit_s(CHECKPOINT) == START_S  # each kind has its own


def test_a_derived_limit_is_never_below_the_floor(tmp_path, clock):
    watchdog = HangWatchdog(0, tmp_path)
    for _ in range(5):
        _run(watchdog, clock, STEP, 0.01)
    assert watchdog.limit_s(STEP) == FLOOR_S


def test_a_set_timeout_is_a_steps_limit_and_the_least_an_eval_or_save_gets(tmp_path, clock):
    watchdog = HangWatchdog(20.0, tmp_path)
    assert watchdog.limit_s(STEP) == 20.0
    assert watchdog.limit_s(EVAL) == watchdog.limit_s(CHECKPOINT) == START_S
    for _ in range(3):
        _run(watchdog, clock, CHECKPOINT, 0.5)
    assert watchdog.limit_s(CHECKPOINT) == FLOOR_S


def test_a_checkpoint_into_a_store_gets_at_least_the_stores_deadlines(tmp_path, clock):
    from kempnerforge.config.loader import load_config
    from kempnerforge.training.store_checks import store_save_limits

    config = load_config(None, ["--checkpoint.dir=s3://b/ckpt", "--checkpoint.store_timeout_s=600"])
    floors = store_save_limits(config.checkpoint)
    assert floors == {CHECKPOINT: FLOOR_S + 4 * 600}  # the checks, uploads, commit, retention
    assert store_save_limits(load_config(None, []).checkpoint) == {}
    watchdog = HangWatchdog(0, tmp_path, at_least=floors)
    for _ in range(3):
        _run(watchdog, clock, CHECKPOINT, 0.5)
    assert watchdog.limit_s(CHECKPOINT) == FLOOR_S + 2400  # past the 600 s a stall may take
    assert watchdog.limit_s(STEP) == START_S


def test_a_save_inside_a_step_is_not_the_steps_time_and_restarts_its_limit(tmp_path, clock):
    watchdog = HangWatchdog(0, tmp_path)
    for _ in range(2):
        _run(watchdog, clock, STEP, 1.0)
    with watchdog.watch(STEP, 3):
        clock.now += 2.0
        _run(watchdog, clock, CHECKPOINT, 500.0, step=3)
        outer = watchdog._frames[-1]
        assert outer.kind == STEP and outer.resumed == clock.now  # its limit runs anew
        clock.now += 1.0
    assert watchdog._seen[STEP] == (3, 3.0)  # 2 s + 1 s of its own, not the save's 500 s
    assert watchdog._frames == []


def test_watch_does_nothing_without_a_watchdog_in_force(tmp_path):
    with hang.watch(STEP, 1):
        pass
    watchdog = HangWatchdog(-1, tmp_path)  # turned off: no thread, nothing in force
    with watchdog:
        assert hang._current is None and watchdog._thread is None


def test_a_watchdog_in_force_is_what_watch_reports_to(tmp_path):
    with HangWatchdog(0, tmp_path) as watchdog, hang.watch(EVAL, 7):
        assert [(f.kind, f.step) for f in watchdog._frames] == [(EVAL, 7)]
    assert hang._current is None and not watchdog.fired


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 2e7])
def test_a_hang_timeout_that_is_no_duration_is_refused(value):
    with pytest.raises(ConfigError, match=r"^train.hang_timeout_s = "):
        TrainConfig(hang_timeout_s=value)


def test_the_grace_before_exiting_is_a_few_of_the_slowest_steps(tmp_path, clock):
    watchdog = HangWatchdog(10.0, tmp_path)
    # Before steps were timed: the limit itself, at most GRACE_MAX_S.
    assert watchdog.grace_s(10.0) == 10.0
    assert watchdog.grace_s(1000.0) == hang.GRACE_MAX_S
    for seconds in (5.0, 0.25, 0.5, 0.25):  # the first is not counted (warm-up)
        _run(watchdog, clock, STEP, seconds)
    # GRACE_STEPS of the slowest counted step (0.5 s), at least GRACE_MIN_S.
    assert watchdog.grace_s(10.0) == max(hang.GRACE_MIN_S, hang.GRACE_STEPS * 0.5)
    _run(watchdog, clock, STEP, 2.0)
    assert watchdog.grace_s(10.0) == hang.GRACE_STEPS * 2.0
    assert watchdog.grace_s(4.0) == 4.0  # never past the limit
