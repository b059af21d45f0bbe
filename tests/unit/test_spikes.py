"""The loss-spike rule: its window, threshold and warm-up, and the NaN detector skipping
spikes like non-finite steps (also in the loop, and across a rollback and a resume)."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.resilience.nan import LOSS_SPIKE, NON_FINITE, NaNAbortError, NaNDetector
from kempnerforge.resilience.spikes import LossSpikeRule
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import events


def _filled(rule: LossSpikeRule, losses: list[float]) -> LossSpikeRule:
    for loss in losses:
        rule.record(loss)
    return rule


def test_threshold_is_mean_plus_sigmas_times_the_sample_std_of_the_window():
    history = [2.0, 2.2, 1.9, 2.1, 2.05, 1.95]
    rule = _filled(LossSpikeRule(window=6, sigmas=3.0, min_history=4), history)
    bound = rule.bound()
    assert bound is not None and bound.history == 6
    expected = statistics.mean(history) + 3.0 * statistics.stdev(history)
    assert bound.threshold == pytest.approx(expected)
    assert rule.is_spike(expected + 1e-6) and not rule.is_spike(expected - 1e-6)


def test_no_verdict_before_the_window_holds_min_history_losses():
    rule = _filled(LossSpikeRule(window=8, sigmas=1.0, min_history=4), [1.0, 1.1, 0.9])
    assert rule.bound() is None and not rule.is_spike(1e9)
    rule.record(1.0)
    assert rule.is_spike(1e9)


def test_min_history_defaults_to_half_the_window_as_olmo_core_does():
    assert LossSpikeRule(128, 6.0).min_history == 64
    assert LossSpikeRule(2, 6.0).min_history == 2


def test_the_window_rolls_and_skips_non_finite_losses():
    rule = _filled(LossSpikeRule(window=3, sigmas=6.0), [100.0, 1.0, math.nan, 2.0, 3.0])
    assert list(rule.losses) == [1.0, 2.0, 3.0]


def test_window_zero_turns_the_rule_off():
    rule = _filled(LossSpikeRule(0, 1.0), [1.0] * 10)
    assert not rule.enabled and rule.bound() is None and not rule.is_spike(1e30)


def test_a_spike_is_skipped_counted_in_the_streak_and_named_in_the_stop_message():
    detector = NaNDetector(2, LossSpikeRule(window=4, sigmas=2.0, min_history=4))
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.0], start=1):
        assert detector.check(loss, 0.5, step)
    assert detector.fault_of(50.0, 0.5) == LOSS_SPIKE
    assert not detector.check(50.0, 0.5, step=5)
    assert detector.last_reason == LOSS_SPIKE and detector.consecutive == 1
    assert not detector.check(math.nan, 0.5, step=5)
    assert detector.last_reason == NON_FINITE and detector.exhausted
    message = str(NaNAbortError(detector.streak))
    assert message.startswith(
        "2 consecutive attempts had a non-finite loss or gradient norm, or a loss spike"
    )


def test_the_spike_window_survives_the_detector_state():
    detector = NaNDetector(3, LossSpikeRule(window=4, sigmas=6.0))
    for step, loss in enumerate([3.0, 2.5, 2.4, 2.2, 2.1], start=1):
        detector.check(loss, 1.0, step)
    restored = NaNDetector(3, LossSpikeRule(window=4, sigmas=6.0))
    restored.load_state_dict(detector.state_dict())
    assert list(restored.spikes.losses) == [2.5, 2.4, 2.2, 2.1]
    old = detector.state_dict()
    del old["spikes"]  # saved before the rule existed
    restored.load_state_dict(old)
    assert list(restored.spikes.losses) == []


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("--train.spike_window=1", "train.spike_window"),
        ("--train.spike_window=-1", "train.spike_window"),
        ("--train.spike_sigmas=0", "train.spike_sigmas"),
        ("--train.spike_min_history=1", "train.spike_min_history"),
        ("--train.spike_min_history=200", "train.spike_min_history"),
        ("--train.max_hardware_faults=-1", "train.max_hardware_faults"),
    ],
)
def test_bad_spike_and_fault_settings_name_their_field(override, field):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert str(info.value).startswith(f"{field} = ")


class SpikeOnce:
    """Test-only fault: the loss of one chosen call is 50 times too large (finite)."""

    def __init__(self, real, bad_call):
        self.real, self.bad_call, self.calls = real, bad_call, 0

    def __call__(self, logits, labels):
        self.calls += 1
        loss = self.real(logits, labels)
        return loss * 50.0 if self.calls == self.bad_call else loss


SPIKES = [
    "--train.spike_window=4",
    "--train.spike_sigmas=3",
    "--scheduler.name=constant",
    "--train.loss_chunk_tokens=0",
    "--train.attribute_faults=false",  # the skip itself; a re-run is test_attribution's
]


def _session(overrides):
    config = load_config(None, overrides)
    config.validate(1)
    return build_session(config, RuntimeContext())


def test_the_loop_skips_a_loss_spike_like_a_non_finite_step(tiny_overrides):
    session = _session([*tiny_overrides, *SPIKES, "--train.max_steps=8"])
    session.loss_fn = SpikeOnce(session.loss_fn, bad_call=6)
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == 8 and session.loss_fn.calls == 9
    [skip] = events(session.config.run_dir, "nan_skip")
    assert skip["reason"] == LOSS_SPIKE and skip["step"] == 6
    assert skip["loss"] > 10 and math.isfinite(skip["loss"])
    assert session.nan_detector.total_skipped == 1


def test_a_rollback_restores_the_checkpoints_spike_window_and_a_resume_keeps_it(tiny_overrides):
    overrides = [
        *tiny_overrides,
        *SPIKES,
        "--train.max_steps=8",
        "--checkpoint.interval=5",
        "--train.nan_consecutive_max=1",
    ]
    session = _session(overrides)
    session.loss_fn = SpikeOnce(session.loss_fn, bad_call=7)
    saved: dict[int, list[float]] = {}

    real_save = session.checkpointer.save

    def remember_window(step, **kwargs):
        saved[step] = list(kwargs["train_state"]["nan_detector"]["spikes"]["losses"])
        return real_save(step, **kwargs)

    session.checkpointer.save = remember_window
    with session.tracker:
        run_training_loop(session)
    [rollback] = events(session.config.run_dir, "nan_rollback")
    assert rollback["step"] == 5 and rollback["from_step"] == 6
    assert len(saved[5]) == 4
    # After the rollback the window held step 5's losses again, not the spike; the steps
    # retaken since then pushed them out one by one.
    assert max(session.nan_detector.spikes.losses) < 10
    resumed = _session([*overrides, "--train.max_steps=9"])
    with resumed.tracker:
        assert resume_session(resumed)[0] == 8
    assert list(resumed.nan_detector.spikes.losses) == saved[8]
    assert torch.tensor(saved[8]).isfinite().all()
