"""NaNDetector: which steps are good, the consecutive count, exhaustion and its state."""

from __future__ import annotations

import logging
import math

import pytest

from kempnerforge.resilience.nan import NaNAbortError, NaNDetector

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
    detector.check(NAN, 1.0, step=4)
    detector.check(1.0, NAN, step=5)
    restored = NaNDetector(5)
    restored.load_state_dict(detector.state_dict())
    detector.record_rollback(0.5)
    restored.load_state_dict(detector.state_dict())
    assert restored.state_dict() == {
        "consecutive": 0,
        "total_skipped": 2,
        "skipped_steps": [4, 5],
        "rollbacks": 1,
        "lr_scale": 0.5,
    }
    assert all(type(v) in (int, float, list) for v in detector.state_dict().values())


def test_a_bad_step_warns_with_the_step_and_the_value(caplog):
    logger = logging.getLogger("kempnerforge")
    logger.addHandler(caplog.handler)
    try:
        NaNDetector(3).check(1.0, INF, step=17)
    finally:
        logger.removeHandler(caplog.handler)
    assert "step 17: non-finite grad_norm" in caplog.text


def test_abort_error_names_the_steps():
    assert "steps 8, 9, 10" in str(NaNAbortError([8, 9, 10]))
