"""The loop and its step bodies, run for real on a tiny model and token file."""

from __future__ import annotations

import dataclasses
import logging
import math
import os

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.config.vlm import VLMConfig
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.resilience.nan import NaNAbortError
from kempnerforge.training.build import build_session
from kempnerforge.training.hooks import TrainingHook
from kempnerforge.training.loop import (
    BatchStream,
    StepResult,
    checkpoint_extra,
    pipeline_step,
    run_training_loop,
    select_step_fn,
    text_step,
    vlm_step,
)
from kempnerforge.training.loss import IGNORE_INDEX
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import read_rows
from tests.support.tolerance import assert_reordered_close, reorder_atol, transformer_terms


def make_session(overrides: list[str]):
    config = load_config(None, overrides)
    config.validate(1)
    return build_session(config, RuntimeContext())


def batches_of(loader, n):
    it = iter(loader)
    return [next(it) for _ in range(n)]


def same_batch(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --- BatchStream -------------------------------------------------------------------------


def test_batch_stream_restarts_at_the_epoch_boundary(tiny_overrides):
    session = make_session(tiny_overrides)
    stream = session.batches
    per_epoch = len(session.data.dataloader)
    seen = [stream.next_batch() for _ in range(per_epoch + 2)]
    assert len(seen) == per_epoch + 2  # went past the end without StopIteration
    assert all(b["input_ids"].shape == (4, 32) for b in seen)


def test_batch_stream_reset_continues_inside_the_epoch(tiny_overrides):
    reference = make_session(tiny_overrides).batches
    expected = [reference.next_batch() for _ in range(5)]
    stream = make_session(tiny_overrides).batches
    got = [stream.next_batch() for _ in range(2)]
    stream.reset()
    got += [stream.next_batch() for _ in range(3)]
    assert all(same_batch(a, b) for a, b in zip(expected, got, strict=True))


def test_batch_stream_reads_the_dataloader_on_every_access(tiny_overrides):
    session = make_session(tiny_overrides)
    stream = session.batches
    stream.next_batch()
    marker = {"input_ids": torch.zeros(1, 1, dtype=torch.long)}
    session.data.dataloader = [marker]
    assert stream.dataloader is session.data.dataloader
    assert stream.next_batch() is marker


def test_batch_stream_without_a_dataloader(tiny_overrides):
    session = make_session(tiny_overrides)
    session.data.dataloader = None
    stream = BatchStream(session.data)
    assert not stream.has_data
    with pytest.raises(RuntimeError, match="no training data is configured"):
        stream.next_batch()


def test_session_batches_rebuilt_when_data_is_replaced(tiny_overrides):
    session = make_session(tiny_overrides)
    first = session.batches
    assert session.batches is first
    session.data = dataclasses.replace(session.data)
    assert session.batches is not first


def test_a_session_given_an_eval_dataloader_says_it_is_not_read(tiny_overrides, log):
    session = make_session(tiny_overrides)
    log.clear()
    dataclasses.replace(session)  # none given: nothing said
    assert not [r for r in log.records if r.levelno >= logging.WARNING]
    dataclasses.replace(session, eval_dataloader=[{}])
    assert "TrainingSession.eval_dataloader is not read" in log.text


# --- StepResult and dispatch -------------------------------------------------------------


def test_step_result_defaults():
    result = StepResult(loss=1.0, grad_norm=2.0)
    assert result.text_tokens is None
    assert result.dataset_token_counts == {} and result.dataset_loss_sums == {}
    assert result.dataset_loss_counts == {}
    assert StepResult(1.0, 2.0).dataset_token_counts is not result.dataset_token_counts


def test_select_step_fn_pp_wins_then_vlm_then_text(monkeypatch):
    config = load_config(None)
    assert select_step_fn(config) is text_step
    # A [vlm] table makes the job vision-language (the family registered with that section).
    monkeypatch.setattr(config, "vlm", VLMConfig())
    assert select_step_fn(config) is vlm_step
    config.distributed.pp = 2
    assert select_step_fn(config) is pipeline_step


# --- text_step -----------------------------------------------------------------------------


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("uneven", [False, True])
def test_grad_accumulation_matches_one_big_batch(tiny_overrides, uneven):
    base = make_session(tiny_overrides)
    first, second = batches_of(base.data.dataloader, 2)
    big = {k: torch.cat([first[k], second[k]]) for k in first}
    if uneven:
        big["labels"][:4, 5:] = IGNORE_INDEX  # first half: far fewer supervised tokens
    halves = [{k: v[:4] for k, v in big.items()}, {k: v[4:] for k, v in big.items()}]

    one = make_session(tiny_overrides + ["--train.batch_size=8", "--train.grad_clip_norm=0"])
    one.data.dataloader = [big]
    result_one = text_step(one, 0)
    two = make_session(tiny_overrides + ["--train.grad_accum_steps=2", "--train.grad_clip_norm=0"])
    two.data.dataloader = halves
    result_two = text_step(two, 0)

    # One batch of 8 against two of 4: the same terms summed in another order, the
    # model's chain plus the 8 * 32 tokens; the gradient norm moves no more, relatively,
    # than the gradients do.
    cfg, tokens = one.config.model, 8 * 32
    forward = transformer_terms(cfg, 32, backward=False) + tokens
    backward = transformer_terms(cfg, 32) + tokens
    loss_atol = reorder_atol(torch.float32, forward, result_two.loss)
    assert result_one.loss == pytest.approx(result_two.loss, rel=0, abs=loss_atol)
    norm_atol = reorder_atol(torch.float32, backward, result_two.grad_norm)
    assert result_one.grad_norm == pytest.approx(result_two.grad_norm, rel=0, abs=norm_atol)
    g1, g2 = _grads(one.model), _grads(two.model)
    assert g1.keys() == g2.keys()
    for name in g1:
        assert_reordered_close(g1[name], g2[name], terms=backward)


def test_text_step_loss_is_token_weighted_mean_cross_entropy(tiny_overrides):
    session = make_session(tiny_overrides)
    batch = batches_of(session.data.dataloader, 1)[0]
    session.data.dataloader = [batch]
    with torch.no_grad():
        doc_ids = batch["doc_ids"]
        logits = session.model(batch["input_ids"], doc_ids=doc_ids)
        expected = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX
        )
    result = text_step(session, 0)
    # The step's fused head loss against whole logits: the model's chain and 4 * 32
    # tokens summed in another order.
    terms = transformer_terms(session.config.model, 32, backward=False) + 4 * 32
    atol = reorder_atol(torch.float32, terms, float(expected))
    assert result.loss == pytest.approx(float(expected), rel=0, abs=atol)
    assert result.grad_norm > 0


# --- run_training_loop -------------------------------------------------------------------


class RecordingHook(TrainingHook):
    def __init__(self):
        self.events: list[tuple] = []

    def on_step_end(self, ctx):
        self.events.append(("step", ctx.step))

    def on_eval_end(self, step, metrics):
        self.events.append(("eval", step, sorted(metrics)))

    def on_checkpoint_save(self, step, path):
        self.events.append(("save", step, os.path.basename(path)))

    def on_train_end(self, step, tokens_seen):
        self.events.append(("end", step, tokens_seen))


def test_loop_runs_to_max_steps_with_eval_checkpoints_and_hooks(tiny_overrides):
    session = make_session(
        tiny_overrides + ["--eval.interval=3", "--eval.steps=2", "--checkpoint.interval=4"]
    )
    hook = RecordingHook()
    session.hooks.add(hook)
    with session.tracker:
        step, tokens = run_training_loop(session)
    assert step == 6 and tokens == 6 * 4 * 32
    assert [e[1] for e in hook.events if e[0] == "step"] == [1, 2, 3, 4, 5, 6]
    assert [e for e in hook.events if e[0] == "eval"] == [
        ("eval", 3, ["eval_loss", "eval_ppl", "eval_tokens"]),
        ("eval", 6, ["eval_loss", "eval_ppl", "eval_tokens"]),
    ]
    # step 4 on schedule, step 6 is the final off-schedule save
    assert [e for e in hook.events if e[0] == "save"] == [
        ("save", 4, "step_4"),
        ("save", 6, "step_6"),
    ]
    assert hook.events[-1] == ("end", 6, tokens)
    rows = read_rows(session.config.run_dir)
    train_rows = [r for r in rows if "loss" in r and "event" not in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "lr", "tokens_seen", "tokens_per_sec", "step_time_s"):
        assert key in train_rows[0]
    for row in train_rows:  # the loop passes each step's wait for batches, and the device
        assert 0.0 <= row["data_wait_share"] < 1.0 and row["peak_memory_gib"] > 0.05
    eval_rows = [r for r in rows if "eval_loss" in r]
    assert eval_rows and math.isclose(eval_rows[0]["eval_ppl"], math.exp(eval_rows[0]["eval_loss"]))


def test_loss_falls_on_learnable_data(tiny_overrides):
    session = make_session(
        tiny_overrides + ["--train.max_steps=40", "--optimizer.lr=3e-3", "--metrics.log_interval=1"]
    )
    with session.tracker:
        run_training_loop(session)
    losses = [r["loss"] for r in read_rows(session.config.run_dir) if "loss" in r]
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5


def test_nan_steps_leave_every_parameter_unchanged_then_stop(tiny_overrides):
    session = make_session(tiny_overrides + ["--train.nan_consecutive_max=3"])
    real_loss = session.loss_fn
    session.loss_fn = lambda logits, labels: real_loss(logits, labels) * float("nan")
    before = {n: p.detach().clone() for n, p in session.model.named_parameters()}
    with session.tracker, pytest.raises(NaNAbortError, match="3 consecutive"):
        run_training_loop(session)
    for name, param in session.model.named_parameters():
        assert torch.equal(param, before[name]), name
        assert param.grad is None
    assert session.optimizer.state_dict()["state"] == {}
    assert session.scheduler.last_epoch == 0
    assert session.nan_detector.total_skipped == 3
    events = [r for r in read_rows(session.config.run_dir) if r.get("event") == "nan_skip"]
    assert len(events) == 3


def test_non_finite_grad_norm_under_finite_loss_is_skipped(tiny_overrides):
    # Without attribution: with it the clean re-run would keep the step (test_attribution).
    session = make_session(
        tiny_overrides + ["--train.max_steps=2", "--train.attribute_faults=false"]
    )
    weight = session.model.output.weight
    calls = {"n": 0}

    def poison_first(grad):
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 1 else grad

    weight.register_hook(poison_first)
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == 2  # the poisoned attempt advanced nothing; two good steps followed
    assert session.nan_detector.total_skipped == 1
    assert session.scheduler.last_epoch == 2


class StopAfter(TrainingHook):
    """Asks for a stop at the end of step `step`, as a signal arriving mid-step would."""

    def __init__(self, session, step: int) -> None:
        self.session, self.step = session, step

    def on_step_end(self, ctx):
        if ctx.step == self.step:
            self.session.shutdown_handler.request("test")


def test_shutdown_request_saves_and_stops_at_the_step_boundary(tiny_overrides):
    session = make_session(tiny_overrides + ["--train.max_steps=50"])
    hook = RecordingHook()
    session.hooks.add(hook)
    session.hooks.add(StopAfter(session, 1))
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == 1
    assert ("save", 1, "step_1") in hook.events
    assert session.checkpointer.find_resume_path().endswith("step_1")


def test_a_stop_before_the_first_step_trains_nothing_and_saves_nothing(tiny_overrides):
    session = make_session(tiny_overrides + ["--train.max_steps=50"])
    hook = RecordingHook()
    session.hooks.add(hook)
    session.shutdown_handler.request("test")  # e.g. a SIGTERM while the data was prepared
    with session.tracker:
        step, tokens = run_training_loop(session)
    assert (step, tokens) == (0, 0)
    assert [e for e in hook.events if e[0] in ("step", "save")] == []
    assert session.checkpointer.find_resume_path() is None
    shutdown = [r for r in read_rows(session.config.run_dir) if r.get("event") == "shutdown"]
    assert [r["step"] for r in shutdown] == [0]


@pytest.mark.parametrize("optimizer", ["adamw", "lion", "muon", "schedule_free_adamw"])
def test_resume_continues_bitwise_equal(tiny_overrides, optimizer):
    deterministic = tiny_overrides + [
        "--train.deterministic=true",
        "--train.max_steps=8",
        f"--optimizer.name={optimizer}",
        "--eval.interval=2",
        "--eval.steps=1",
    ]
    full = make_session(deterministic)
    with full.tracker:
        run_training_loop(full)
    expected = [r["loss"] for r in read_rows(full.config.run_dir) if "loss" in r]

    run2 = [o for o in deterministic if not o.startswith("--train.run_dir")]
    run2 += [f"--train.run_dir={full.config.run_dir}-split"]
    first = make_session([*run2, "--train.max_steps=8", "--checkpoint.interval=3"])
    first.hooks.add(StopAfter(first, 1))  # stop after step 1 ... then resume
    with first.tracker:
        run_training_loop(first)
    second = make_session(run2)
    with second.tracker:
        step, tokens = resume_session(second)
        assert step == 1
        run_training_loop(second, step=step, tokens_seen=tokens)
    got = [r["loss"] for r in read_rows(second.config.run_dir) if "loss" in r]
    assert got == expected


def test_checkpoint_extra_records_phase_state_and_the_resolved_config(tiny_job_config):
    from kempnerforge.config.job import JobConfig
    from kempnerforge.config.loader import build_dataclass
    from kempnerforge.training.phases import PhaseState

    extra = checkpoint_extra(tiny_job_config, 7, PhaseState())
    assert extra["step"] == 7
    assert extra["phases"] == {"next_index": 0, "lr_scale": 1.0}
    assert extra["config"]["train"]["seq_len"] == 32
    assert build_dataclass(JobConfig, extra["config"], prefix="") == tiny_job_config
    assert "vlm_freeze" not in extra


class CompletenessHook(TrainingHook):
    """Notes, at each on_checkpoint_save, whether the checkpoint is already complete."""

    def __init__(self, session) -> None:
        self.session = session
        self.seen: list[tuple[int, bool]] = []

    def on_checkpoint_save(self, step, path):
        self.seen.append((step, self.session.checkpointer.is_complete(path)))


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_the_save_hook_fires_once_the_checkpoint_is_complete(tiny_overrides, monkeypatch, mode):
    # A slow write, so an async commit lands steps after its save started.
    monkeypatch.setenv("KEMPNERFORGE_FAULT_SAVE_DELAY_S", "0.3")
    session = make_session(
        tiny_overrides + ["--checkpoint.interval=2", f"--checkpoint.async_mode={mode}"]
    )
    hook = CompletenessHook(session)
    session.hooks.add(hook)
    with session.tracker:
        run_training_loop(session)
    assert hook.seen == [(2, True), (4, True), (6, True)]
    rows = [(r.get("event"), r["step"]) for r in read_rows(session.config.run_dir)]
    assert [s for e, s in rows if e == "checkpoint"] == [2, 4, 6]
    committed = [s for e, s in rows if e == "checkpoint_committed"]
    if mode == "disabled":
        assert committed == []  # a sync save is committed when its checkpoint event is written
        return
    assert committed == [2, 4, 6]
    for step in committed:
        assert rows.index(("checkpoint", step)) < rows.index(("checkpoint_committed", step))
    # The save of step 2 was still being written when step 3 was logged.
    assert rows.index((None, 3)) < rows.index(("checkpoint_committed", 2))
    seconds = [
        r["seconds"]
        for r in read_rows(session.config.run_dir)
        if r.get("event") == "checkpoint_committed"
    ]
    assert all(s >= 0.3 for s in seconds)
