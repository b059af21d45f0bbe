"""[[train.phases]]: LR scale and mixture weights switch at start_step, also after resume."""

from __future__ import annotations

import pytest

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.phases import PhaseState, TrainingPhase
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import read_rows

PHASES = "--train.phases=[{start_step=3, lr_scale=0.5}, {start_step=5, lr_scale=0.25}]"


def make_session(overrides):
    config = load_config(None, overrides)
    config.validate(1)
    return build_session(config, RuntimeContext())


def rows(session):
    return read_rows(session.config.run_dir)


def train_rows(session):
    return [r for r in rows(session) if "event" not in r and "loss" in r]


def test_phase_state_fires_once_at_start_step_and_round_trips():
    state = PhaseState([TrainingPhase(5, {}, 0.5), TrainingPhase(2, {}, 2.0)])
    assert [p.start_step for p in state.phases] == [2, 5]
    assert state.advance(1) == [] and state.lr_scale == 1.0
    assert [p.start_step for p in state.advance(7)] == [2, 5]  # a skipped step never misses
    assert state.lr_scale == 0.5 and state.advance(8) == []
    restored = PhaseState([TrainingPhase(2, {}, 2.0), TrainingPhase(5, {}, 0.5)])
    restored.load_state_dict(state.state_dict())
    assert restored.current is restored.phases[1] and restored.lr_scale == 0.5


def test_lr_scale_applies_from_exactly_start_step(tiny_overrides):
    session = make_session(
        tiny_overrides + ["--scheduler.name=constant", "--scheduler.warmup_steps=0", PHASES]
    )
    with session.tracker:
        run_training_loop(session)
    lr = {r["step"]: r["lr"] for r in train_rows(session)}
    peak = session.config.optimizer.lr
    # The row's lr is the one its update used: the phase from step 3 scales step 4 on.
    assert [lr[s] / peak for s in range(1, 7)] == pytest.approx([1, 1, 1, 0.5, 0.5, 0.25])
    events = [r for r in rows(session) if r.get("event") == "phase"]
    assert [(e["step"], e["start_step"]) for e in events] == [(3, 3), (5, 5)]


def test_resume_inside_a_phase_is_bitwise_equal(tiny_overrides):
    # A constant schedule, so stopping the first run at max_steps=4 does not reshape the LR.
    overrides = tiny_overrides + [
        "--train.deterministic=true",
        "--train.max_steps=7",
        "--scheduler.name=constant",
        PHASES,
    ]
    full = make_session(overrides)
    with full.tracker:
        run_training_loop(full)
    split_dir = f"{full.config.run_dir}-split"
    split = [o for o in overrides if not o.startswith("--train.run_dir")]
    split.append(f"--train.run_dir={split_dir}")
    first = make_session([*split, "--train.max_steps=4"])
    with first.tracker:
        run_training_loop(first)
    second = make_session(split)
    with second.tracker:
        step, tokens = resume_session(second)
        assert step == 4 and second.phases.lr_scale == 0.5
        run_training_loop(second, step=step, tokens_seen=tokens)
    expected = [(r["step"], r["loss"], r["lr"]) for r in train_rows(full)]
    assert [(r["step"], r["loss"], r["lr"]) for r in train_rows(second)] == expected


@pytest.mark.parametrize(
    ("phases", "message"),
    [
        ("[{start_step=5}, {start_step=5}]", "train.phases[1].start_step = 5: expected > "),
        ("[{start_step=-1}]", "train.phases[0].start_step = -1: expected an integer >= 0"),
        ("[{start_step=1, lr_scale=0}]", "train.phases[0].lr_scale = 0.0: expected a number > 0"),
        ("[{start_step=1, dataset_weights={a=-1.0}}]", "train.phases[0].dataset_weights.a"),
    ],
)
def test_bad_phases_raise_naming_the_field(phases, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"--train.phases={phases}"])
    assert str(info.value).startswith(message)


def test_phase_weights_without_a_mixture_are_rejected():
    config = load_config(None, ["--train.phases=[{start_step=1, dataset_weights={a=1.0}}]"])
    with pytest.raises(ConfigError, match=r"train.phases\[0\].dataset_weights"):
        config.validate(1)


MIXTURE = '--data.datasets=[{name="a", path="/a", weight=2.0}, {name="b", path="/b"}]'


@pytest.mark.parametrize(
    ("phases", "bad"),
    [
        ("[{start_step=1, dataset_weights={a=0.0, b=0.0}}]", 0),
        # Each phase alone leaves a weight on; in order, the second zeroes the last one.
        ("[{start_step=1, dataset_weights={b=0.0}}, {start_step=2, dataset_weights={a=0.0}}]", 1),
    ],
)
def test_phases_that_leave_no_weight_in_force_are_rejected(phases, bad):
    config = load_config(None, [MIXTURE, f"--train.phases={phases}"])
    with pytest.raises(ConfigError) as info:
        config.validate(1)
    assert info.value.field == f"train.phases[{bad}].dataset_weights"
    assert "at least one weight > 0 in force" in str(info.value)


def test_a_phase_may_turn_a_source_back_on_after_another_zeroed_it():
    phases = (
        "[{start_step=1, dataset_weights={b=0.0}}, {start_step=2, dataset_weights={a=0.0, b=1.0}}]"
    )
    load_config(None, [MIXTURE, f"--train.phases={phases}"]).validate(1)
