"""NaNDetector: which steps are good, the consecutive count, exhaustion and its state."""

from __future__ import annotations

import logging
import math

import pytest

from kempnerforge.resilience.nan import NaNAbortError, NaNDetector, SkippedAttempt

INF, NAN = math.inf, math.nan


@pytest.mark.parametrize(
    ("loss", "grad_norm", "good"),
    [
        (1.5, 0.3, True),
        (NAN, 0.3, False),
        (INF, 0.3, False),
        (-INF, 0.3, False),
        (1.5, NAN, False),  # a finite loss with a NaN gradient norm is still bad
        (1.5, INF, False),
        (NAN, INF, False),
    ],
)
def test_a_step_is_good_only_when_loss_and_grad_norm_are_finite(loss, grad_norm, good):
    assert NaNDetector(3).check(loss, grad_norm, step=1) is good


def test_a_good_step_resets_the_consecutive_count_but_not_the_total():
    detector = NaNDetector(3)
    assert not detector.check(NAN, 1.0, step=1)
    assert not detector.check(1.0, INF, step=2)
    assert detector.consecutive == 2
    assert detector.check(1.0, 1.0, step=3)
    assert detector.consecutive == 0
    assert detector.total_skipped == 2
    assert detector.skipped_steps == [1, 2]


def test_exhausted_after_max_consecutive_bad_steps():
    detector = NaNDetector(2)
    detector.check(NAN, 1.0, step=1)
    assert not detector.exhausted
    detector.check(NAN, 1.0, step=2)
    assert detector.exhausted


def test_skipped_steps_keeps_the_last_100():
    detector = NaNDetector(1000)
    for step in range(150):
        detector.check(NAN, 1.0, step=step)
    assert detector.skipped_steps == list(range(50, 150))
    assert detector.total_skipped == 150


def test_state_dict_round_trip():
    detector = NaNDetector(5)
    detector.check(NAN, 1.0, step=4, data_position=lambda: "epoch 0: windows 3, 9 of d")
    detector.check(1.0, NAN, step=4)
    restored = NaNDetector(5)
    restored.load_state_dict(detector.state_dict())
    detector.record_rollback(0.5)
    restored.load_state_dict(detector.state_dict())
    assert restored.state_dict() == {
        "consecutive": 0,
        "total_skipped": 2,
        "skipped": [[4, 1, "epoch 0: windows 3, 9 of d", "non_finite"], [4, 2, "", "non_finite"]],
        "rollbacks": 1,
        "lr_scale": 0.5,
        "spikes": {"losses": []},
    }
    assert all(type(v) in (int, float, list, dict) for v in detector.state_dict().values())


def test_a_state_saved_with_step_ids_only_still_loads():
    detector = NaNDetector(5)
    detector.load_state_dict({"consecutive": 1, "total_skipped": 3, "skipped_steps": [4, 5]})
    assert detector.skipped_steps == [4, 5] and detector.attempt == 1


def test_a_bad_step_warns_with_the_step_attempt_value_and_data(caplog):
    logger = logging.getLogger("kempnerforge")
    logger.addHandler(caplog.handler)
    try:
        NaNDetector(3).check(1.0, INF, step=17, data_position=lambda: "epoch 2: windows 5 of d")
    finally:
        logger.removeHandler(caplog.handler)
    assert "step 17, attempt 1: non-finite grad_norm" in caplog.text
    assert "data: epoch 2: windows 5 of d" in caplog.text


def test_retries_of_one_step_are_numbered_attempts_not_repeated_steps():
    detector = NaNDetector(3)
    for window in (6, 7, 8):
        detector.check(NAN, 1.0, step=6, data_position=lambda w=window: f"windows {w} of d")
    assert [(s.step, s.attempt) for s in detector.streak] == [(6, 1), (6, 2), (6, 3)]
    message = str(NaNAbortError(detector.streak))
    assert message.startswith("3 consecutive attempts had a non-finite loss or gradient norm")
    assert (
        "(step 6, attempts 1-3 (data: windows 6 of d; windows 7 of d; windows 8 of d))" in message
    )
    assert "steps 6, 6, 6" not in message


def test_a_new_streak_numbers_its_attempts_from_one():
    detector = NaNDetector(5)
    detector.check(NAN, 1.0, step=6)
    detector.check(NAN, 1.0, step=6)
    detector.check(1.0, 1.0, step=6)
    detector.check(NAN, 1.0, step=7)
    detector.check(NAN, 1.0, step=7)
    assert [(s.step, s.attempt) for s in detector.streak] == [(7, 1), (7, 2)]
    assert detector.attempt == 2 and detector.total_skipped == 4


def test_abort_error_groups_attempts_by_step():
    skips = [SkippedAttempt(8, 1), SkippedAttempt(9, 1), SkippedAttempt(9, 2)]
    assert "(step 8, attempt 1; step 9, attempts 1-2)" in str(NaNAbortError(skips))
