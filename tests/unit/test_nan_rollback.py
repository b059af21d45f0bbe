"""NaN handling in the loop: skip, roll back to the last checkpoint, stop after the limit."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.resilience.nan import NaNAbortError
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import events as logged_events
from tests.support.resume import RecordLR

# Two bad attempts in a row roll back to the checkpoint of step 3 at half the LR.
ROLLBACK = [
    "--train.max_steps=8",
    "--checkpoint.interval=3",
    "--train.nan_consecutive_max=2",
    "--train.nan_rollback_lr_scale=0.5",
    "--scheduler.name=constant",
]


def make_session(overrides):
    # PoisonedLoss replaces session.loss_fn, so the step takes the whole-logits path; the
    # clean runs it is compared with bit for bit must take the same path. The skip and
    # rollback machinery is tested on its own: a faulty attempt is not run a second time
    # (attribution re-runs it; tests/unit/test_attribution.py).
    config = load_config(
        None, [*overrides, "--train.loss_chunk_tokens=0", "--train.attribute_faults=false"]
    )
    config.validate(1)
    return build_session(config, RuntimeContext())


class PoisonedLoss:
    """Test-only fault injection: a NaN loss on chosen attempts (1-based micro-batch calls)."""

    def __init__(self, real, bad_attempts, forever_from=None):
        self.real, self.bad, self.forever_from = real, set(bad_attempts), forever_from
        self.calls = 0
        self.labels_seen: list[bytes] = []

    def __call__(self, logits, labels):
        self.calls += 1
        self.labels_seen.append(labels.numpy().tobytes())
        loss = self.real(logits, labels)
        bad = self.calls in self.bad or (self.forever_from and self.calls >= self.forever_from)
        return loss * float("nan") if bad else loss


def events(session, name):
    return logged_events(session.config.run_dir, name)


def test_single_bad_step_is_skipped_and_the_run_finishes(tiny_overrides):
    session = make_session(tiny_overrides)
    session.loss_fn = PoisonedLoss(session.loss_fn, {3})
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == 6
    assert session.loss_fn.calls == 7  # six good updates plus the skipped attempt
    assert session.scheduler.last_epoch == 6  # the scheduler counts updates, like step
    assert len(events(session, "nan_skip")) == 1
    assert events(session, "nan_skip")[0]["loss"] is None  # NaN is written as null


def test_streak_rolls_back_scales_lr_and_does_not_replay_data(tiny_overrides):
    session = make_session(tiny_overrides + ROLLBACK)
    poisoned = PoisonedLoss(session.loss_fn, {5, 6})
    session.loss_fn = poisoned
    with session.tracker:
        step, tokens = run_training_loop(session)
    assert step == 8 and tokens == 8 * 4 * 32
    [rollback] = events(session, "nan_rollback")
    assert rollback["step"] == 3 and rollback["from_step"] == 4
    assert rollback["path"].endswith("step_3") and rollback["lr_scale"] == 0.5
    # 4 good + 2 bad attempts, then steps 4..8 again from the checkpoint at 3
    assert poisoned.calls == 6 + 5
    after = poisoned.labels_seen[6:]
    assert not set(after) & set(poisoned.labels_seen[:6]), "batches were replayed"
    peak = session.config.optimizer.lr
    assert session.optimizer.param_groups[0]["lr"] == pytest.approx(0.5 * peak)
    assert session.nan_detector.rollbacks == 1


def test_rollback_state_survives_a_resume(tiny_overrides):
    overrides = tiny_overrides + ROLLBACK
    session = make_session(overrides)
    session.loss_fn = PoisonedLoss(session.loss_fn, {5, 6})
    with session.tracker:
        run_training_loop(session)
    resumed = make_session([*overrides, "--train.max_steps=9"])
    with resumed.tracker:
        assert resume_session(resumed)[0] == 8
    assert resumed.nan_detector.rollbacks == 1
    assert resumed.optimizer.param_groups[0]["lr"] == pytest.approx(
        0.5 * resumed.config.optimizer.lr
    )
    assert resumed.scheduler.base_lrs == session.scheduler.base_lrs


def test_stops_once_rollbacks_are_used_up(tiny_overrides):
    session = make_session(
        tiny_overrides
        + [
            "--train.max_steps=20",
            "--checkpoint.interval=2",
            "--train.nan_consecutive_max=2",
            "--train.nan_max_rollbacks=1",
        ]
    )
    session.loss_fn = PoisonedLoss(session.loss_fn, set(), forever_from=4)
    with session.tracker, pytest.raises(NaNAbortError, match="after 1 rollback") as info:
        run_training_loop(session)
    assert "nan_max_rollbacks used up" in str(info.value)
    assert len(events(session, "nan_rollback")) == 1


def test_stops_when_there_is_no_checkpoint_to_roll_back_to(tiny_overrides):
    session = make_session(tiny_overrides + ["--train.nan_consecutive_max=2"])
    session.loss_fn = PoisonedLoss(session.loss_fn, set(), forever_from=1)
    with session.tracker, pytest.raises(NaNAbortError, match="no checkpoint to roll back to"):
        run_training_loop(session)


def test_shutdown_during_a_bad_streak_saves_the_last_good_step(tiny_overrides):
    session = make_session(tiny_overrides + ["--train.max_steps=20"])
    poisoned = PoisonedLoss(session.loss_fn, {3, 4})
    session.loss_fn = poisoned

    real_check = session.nan_detector.check

    def check_then_signal(loss, grad_norm, step, data_position=None):
        good = real_check(loss, grad_norm, step, data_position)
        if not good:
            session.shutdown_handler.request("test")
        return good

    session.nan_detector.check = check_then_signal
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == 2  # stopped on the skipped attempt, not after another update
    assert session.checkpointer.find_resume_path().endswith("step_2")


def _saved_run(tiny_overrides):
    session = make_session(tiny_overrides + ["--train.max_steps=2"])
    with session.tracker:
        run_training_loop(session)
    return session


@pytest.mark.parametrize(
    ("override", "field"),
    [("--train.seq_len=16", "train.seq_len"), ("--model.dim=64", "model.dim")],
)
def test_resume_refuses_a_math_change_naming_field_and_both_values(tiny_overrides, override, field):
    _saved_run(tiny_overrides)
    session = make_session(tiny_overrides + ["--train.max_steps=4", override])
    with pytest.raises(ConfigError) as info:
        resume_session(session)
    message = str(info.value)
    assert message.startswith(f"{field} = ")
    assert "as in the checkpoint" in message and "allow_config_change" in message


def test_resume_accepts_harmless_changes_and_an_explicit_override(tiny_overrides):
    _saved_run(tiny_overrides)
    harmless = make_session(tiny_overrides + ["--train.max_steps=9", "--metrics.log_interval=5"])
    assert resume_session(harmless)[0] == 2
    allowed = make_session(
        tiny_overrides + ["--train.seq_len=16", "--checkpoint.allow_config_change=true"]
    )
    assert resume_session(allowed)[0] == 2


def test_load_weights_only_starts_a_new_run_from_the_model(tiny_overrides, tmp_path):
    source = _saved_run(tiny_overrides)
    ckpt = source.checkpointer.find_resume_path()
    fresh = make_session(
        [o for o in tiny_overrides if not o.startswith("--train.run_dir")]
        + [
            f"--train.run_dir={tmp_path / 'new'}",
            f"--checkpoint.resume_from={ckpt}",
            "--checkpoint.load_weights_only=true",
        ]
    )
    assert resume_session(fresh) == (0, 0)
    for (name, a), b in zip(source.model.named_parameters(), fresh.model.parameters(), strict=True):
        assert torch.equal(a, b), name
    assert fresh.optimizer.state_dict()["state"] == {}
    assert fresh.scheduler.last_epoch == 0


def test_the_stop_message_counts_attempts_of_one_step_and_names_their_data(tiny_overrides):
    session = make_session(tiny_overrides + ["--train.nan_consecutive_max=3"])
    poisoned = PoisonedLoss(session.loss_fn, set(), forever_from=6)
    session.loss_fn = poisoned
    with session.tracker, pytest.raises(NaNAbortError) as info:
        run_training_loop(session)
    message = str(info.value)
    assert message.startswith("3 consecutive attempts had a non-finite loss or gradient norm")
    assert "step 6, attempts 1-3 (data: epoch 0: windows " in message
    assert "steps 6, 6, 6" not in message
    # Each attempt names the windows its batch was read from, in the order drawn.
    dataset = session.data.dataset
    for attempt, labels in zip(session.nan_detector.streak, poisoned.labels_seen[5:], strict=True):
        assert attempt.data.endswith(f" of {dataset.path}")
        windows = [int(w) for w in attempt.data.split("windows ")[1].split(" of ")[0].split(", ")]
        expected = torch.stack([dataset[w]["labels"] for w in windows]).numpy().tobytes()
        assert expected == labels
    skips = events(session, "nan_skip")
    assert [(e["step"], e["attempt"]) for e in skips] == [(6, 1), (6, 2), (6, 3)]
    assert all(e["data"].startswith("epoch 0: windows ") for e in skips)


def test_after_a_rollback_the_lr_keeps_the_phase_scale(tiny_overrides, tmp_path):
    phases = tmp_path / "phases.toml"
    phases.write_text("[[train.phases]]\nstart_step = 0\nlr_scale = 0.5\n")
    config = load_config(
        str(phases),
        [
            *tiny_overrides,
            *ROLLBACK,
            "--scheduler.warmup_steps=0",
            "--train.loss_chunk_tokens=0",
            "--train.attribute_faults=false",
        ],
    )
    config.validate(1)
    session = build_session(config, RuntimeContext())
    session.loss_fn = PoisonedLoss(session.loss_fn, {5, 6})
    hook = RecordLR()
    session.hooks.add(hook)
    with session.tracker:
        run_training_loop(session)
    peak = config.optimizer.lr
    assert hook.lrs[3] == pytest.approx(0.5 * peak)  # the phase scale before the rollback
    # Every update after the rollback (steps 4..8 again) uses phase scale x rollback scale.
    assert [hook.lrs[s] for s in range(4, 9)] == pytest.approx([0.25 * peak] * 5)
