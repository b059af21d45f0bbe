"""Which checkpoint a launch resumes, and what a changed setting does on resume."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.optim.scheduler import lr_factor
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.resume_plan import FRESH_OPTIMIZER, FULL, plan_resume, resume_session
from tests.support.resume import RecordLR


def session_for(overrides):
    config = load_config(None, overrides)
    config.validate(1)
    return build_session(config, RuntimeContext())


def train(overrides, *, resume=True):
    """Build, resume (as the CLI does) and run to train.max_steps; return the session."""
    session = session_for(overrides)
    with session.tracker:
        step, tokens = resume_session(session) if resume else (0, 0)
        run_training_loop(session, step=step, tokens_seen=tokens)
    return session


def without_run_dir(overrides):
    return [o for o in overrides if not o.startswith("--train.run_dir")]


# --- a run's own checkpoints win --------------------------------------------------------


def test_a_weights_only_start_resumes_fully_from_its_own_checkpoint_when_requeued(
    tiny_overrides, tmp_path
):
    source = train(tiny_overrides + ["--train.max_steps=2"])
    start = without_run_dir(tiny_overrides) + [
        f"--train.run_dir={tmp_path / 'finetune'}",
        f"--checkpoint.resume_from={source.checkpointer.find_resume_path()}",
        "--checkpoint.load_weights_only=true",
        "--checkpoint.interval=3",
        "--train.max_steps=3",
    ]
    first = train(start)
    assert first.scheduler.last_epoch == 3
    # Requeued with the same command line, and a longer run: continue at 3, not at 0.
    requeued = session_for([*start, "--train.max_steps=6"])
    plan = plan_resume(requeued.config, requeued.checkpointer)
    assert plan.mode == FULL and plan.path.endswith("finetune/checkpoints/step_3")
    with requeued.tracker:
        assert resume_session(requeued) == (3, 3 * 4 * 32)
    assert requeued.optimizer.state  # the moments came back, not a fresh optimizer


def test_an_explicit_resume_from_is_only_where_a_run_starts(tiny_overrides, tmp_path, log):
    source = train(tiny_overrides + ["--train.max_steps=2"])
    other = source.checkpointer.find_resume_path()
    start = without_run_dir(tiny_overrides) + [
        f"--train.run_dir={tmp_path / 'continued'}",
        f"--checkpoint.resume_from={other}",
        "--train.max_steps=4",
    ]
    first = session_for(start)
    with first.tracker:
        assert resume_session(first)[0] == 2  # from the other run's checkpoint
        run_training_loop(first, step=2, tokens_seen=2 * 4 * 32)
    again = session_for([*start, "--train.max_steps=5"])
    with again.tracker:
        assert resume_session(again)[0] == 4  # its own step_4, not the other run's step_2
    assert "a run's own checkpoints win over checkpoint.resume_from" in log.text


def test_resume_from_none_starts_over_and_says_what_it_ignores(tiny_overrides, log):
    train(tiny_overrides + ["--train.max_steps=2"])
    fresh = session_for(tiny_overrides + ["--checkpoint.resume_from=none"])
    assert plan_resume(fresh.config, fresh.checkpointer) is None
    assert "starting at step 0 although" in log.text


# --- a link among the run's checkpoints is decided at start-up --------------------------


def _linked_start(tiny_overrides, tmp_path, *extra):
    """A new run whose checkpoint directory links in another run's step_2."""
    source = train(tiny_overrides + ["--train.max_steps=2"])
    target = source.checkpointer.find_resume_path()
    directory = tmp_path / "linked" / "checkpoints"
    directory.mkdir(parents=True)
    link = directory / "step_2"
    link.symlink_to(target, target_is_directory=True)
    overrides = without_run_dir(tiny_overrides) + [f"--train.run_dir={tmp_path / 'linked'}"]
    return session_for([*overrides, "--train.max_steps=4", *extra]), link, target


def test_a_linked_step_the_run_would_save_is_refused_before_training(tiny_overrides, tmp_path):
    session, link, target = _linked_start(tiny_overrides, tmp_path)
    with pytest.raises(ConfigError) as error:
        plan_resume(session.config, session.checkpointer)
    assert str(error.value) == (
        f"checkpoint.dir = '{link.parent}': expected only checkpoints this run saves under "
        f"the step_<N> names it may save ({link} is a symbolic link to {target}, which "
        "saving step 2 would replace, and this run may save any step from 1 to 4; a run "
        "never follows or replaces a link or file among its checkpoints: move it away, and "
        "to start from another run's checkpoint set checkpoint.resume_from to its path "
        "instead)"
    )
    assert error.value.field == "checkpoint.dir"


def test_a_linked_step_named_in_resume_from_is_where_the_run_starts(tiny_overrides, tmp_path):
    session, link, _ = _linked_start(tiny_overrides, tmp_path, "--checkpoint.resume_from=step_2")
    with session.tracker:
        step, tokens = resume_session(session)
        assert step == 2  # loaded through the link: the run never saves step 2 again
        assert run_training_loop(session, step=step, tokens_seen=tokens)[0] == 4
    assert link.is_symlink() and (link.parent / "step_4").is_dir()


# --- changed settings: applied, or refused naming the field -----------------------------


def test_a_changed_lr_and_weight_decay_take_effect_at_the_resumed_step(tiny_overrides, log):
    train(tiny_overrides + ["--train.max_steps=2", "--optimizer.lr=1e-3"])
    resumed = session_for(
        tiny_overrides
        + ["--optimizer.lr=5e-2", "--optimizer.weight_decay=0", "--train.max_steps=3"]
    )
    hook = RecordLR()
    resumed.hooks.add(hook)
    with resumed.tracker:
        step, tokens = resume_session(resumed)
        run_training_loop(resumed, step=step, tokens_seen=tokens)
    expected = 5e-2 * lr_factor(2, resumed.config.scheduler, 3)
    assert hook.lrs[3] == pytest.approx(expected)
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.0, 0.0]
    assert "optimizer.lr changed from 0.001 to 0.05: the new value takes effect" in log.text
    assert "optimizer.weight_decay changed from 0.1 to 0.0: the new value takes effect" in log.text


def test_the_first_step_after_a_resume_uses_the_new_schedule(tiny_overrides):
    overrides = tiny_overrides + ["--scheduler.warmup_steps=1", "--optimizer.lr=1e-2"]
    train([*overrides, "--train.max_steps=4"])
    resumed = session_for([*overrides, "--train.max_steps=40"])
    hook = RecordLR()
    resumed.hooks.add(hook)
    with resumed.tracker:
        step, tokens = resume_session(resumed)
        run_training_loop(resumed, step=step, tokens_seen=tokens)
    config = resumed.config
    # Step 5 already follows the 40-step cosine, not the old 4-step one's floor.
    assert hook.lrs[5] == pytest.approx(1e-2 * lr_factor(4, config.scheduler, 40))
    assert hook.lrs[5] > 2 * 1e-2 * lr_factor(4, config.scheduler, 4)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("--model.rope_theta=500000.0", "model.rope_theta"),
        ("--data.document_masking=false", "data.document_masking"),
        ("--train.mixed_precision=bf16", "train.mixed_precision"),
        ("--train.z_loss_weight=0.001", "train.z_loss_weight"),
        ("--optimizer.decay_embeddings=true", "optimizer.decay_embeddings"),
        ("--train.seed=7", "train.seed"),
    ],
)
def test_a_change_to_what_the_state_means_is_refused_naming_the_field(
    tiny_overrides, override, field
):
    train(tiny_overrides + ["--train.max_steps=2"])
    session = session_for([*tiny_overrides, override])
    with pytest.raises(ConfigError) as info:
        plan_resume(session.config, session.checkpointer)
    message = str(info.value)
    assert message.startswith(f"{field} = ")
    assert "as in the checkpoint" in message and "allow_config_change" in message


def test_allow_config_change_resumes_and_logs_each_change(tiny_overrides, log):
    train(tiny_overrides + ["--train.max_steps=2"])
    session = session_for(
        tiny_overrides + ["--model.rope_theta=20000.0", "--checkpoint.allow_config_change=true"]
    )
    with session.tracker:
        assert resume_session(session)[0] == 2
    assert "model.rope_theta changed from 10000.0 to 20000.0" in log.text


def test_harmless_changes_are_logged_not_refused(tiny_overrides, log):
    train(tiny_overrides + ["--train.max_steps=2"])
    session = session_for(tiny_overrides + ["--metrics.log_interval=5", "--train.max_steps=9"])
    with session.tracker:
        assert resume_session(session)[0] == 2
    assert "metrics.log_interval changed from 1 to 5" in log.text
    assert "train.max_steps changed from 2 to 9" in log.text


# --- another optimizer --------------------------------------------------------------------


@pytest.mark.parametrize("new", ["lion", "muon"])
def test_another_optimizer_is_refused_naming_the_field(tiny_overrides, new):
    train(tiny_overrides + ["--train.max_steps=2"])
    session = session_for([*tiny_overrides, f"--optimizer.name={new}"])
    with pytest.raises(ConfigError) as info:
        plan_resume(session.config, session.checkpointer)
    message = str(info.value)
    assert message.startswith(f"optimizer.name = '{new}': expected 'adamw' as in the checkpoint")
    assert "checkpoint.reset_optimizer=true" in message


@pytest.mark.parametrize("new", ["lion", "muon"])
def test_reset_optimizer_resumes_weights_step_and_data_with_a_fresh_state(tiny_overrides, new, log):
    source = train(tiny_overrides + ["--train.max_steps=2"])
    weights = {n: p.detach().clone() for n, p in source.model.named_parameters()}
    data_state = source.data.state_dict()
    session = session_for(
        [*tiny_overrides, f"--optimizer.name={new}", "--checkpoint.reset_optimizer=true"]
    )
    plan = plan_resume(session.config, session.checkpointer)
    assert plan.mode == FRESH_OPTIMIZER
    with session.tracker:
        step, tokens = resume_session(session)
        assert (step, tokens) == (2, 2 * 4 * 32)
        assert session.optimizer.state_dict()["state"] == {}
        for name, param in session.model.named_parameters():
            assert torch.equal(param, weights[name]), name
        assert session.data.state_dict() == data_state
        assert session.scheduler.last_epoch == 2
        run_training_loop(session, step=step, tokens_seen=tokens)
    assert "optimizer.name changed from 'adamw' to" in log.text
    assert "with a fresh" in log.text


def test_a_checkpoint_past_max_steps_is_refused_naming_max_steps(tiny_overrides):
    train(tiny_overrides + ["--train.max_steps=3"])
    session = session_for(tiny_overrides + ["--train.max_steps=2"])
    with pytest.raises(ConfigError, match=r"^train.max_steps = 2: expected >= 3, the step of"):
        plan_resume(session.config, session.checkpointer)


def test_a_new_layout_may_resplit_the_batch_but_not_change_the_global_batch():
    from kempnerforge.config.loader import config_to_dict
    from kempnerforge.training.resume_guard import check_config_changes

    saved = config_to_dict(load_config(None, ["--train.batch_size=4"]))
    two_ranks = load_config(None, ["--train.batch_size=2", "--distributed.dp_shard=2"])
    # 4 sequences per step either way: one process then, two ranks of 2 now.
    check_config_changes(two_ranks, saved, "ckpt", saved_world_size=1, world_size=2)
    accumulating = load_config(None, ["--train.batch_size=1", "--train.grad_accum_steps=4"])
    check_config_changes(accumulating, saved, "ckpt", saved_world_size=1, world_size=1)
    with pytest.raises(
        ConfigError, match=r"^train.batch_size = 2: expected 4 as in the checkpoint"
    ):
        check_config_changes(
            load_config(None, ["--train.batch_size=2"]), saved, "ckpt", saved_world_size=1
        )
