"""A run stopped by a real SIGTERM and resumed matches the uninterrupted run bit for bit.

Deterministic CPU runs over a corpus of five batches per epoch, so stops land before, at and
after epoch boundaries, between gradient-accumulation windows and right after an eval.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest

from kempnerforge.training.hooks import StepContext, TrainingHook
from kempnerforge.training.loop import TrainingSession, run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import eval_rows, events, train_rows
from tests.support.resume import (
    assert_optimizer_states_bitwise_equal,
    assert_tensors_bitwise_equal,
    draw_from_every_generator,
    make_session,
    optimizer_state_of,
    parameters_of,
    rng_state_of,
    write_small_corpus,
)
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

MAX_STEPS = 8
BATCHES_PER_EPOCH = 5  # 23 windows of 33 tokens at batch 4: 5 batches, 3 windows dropped


class SigtermAtSteps(TrainingHook):
    """Sends this process a real SIGTERM at the end of each listed step.

    Also notes the generators' states at that moment: the checkpoint must carry them.
    """

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps
        self.sent: list[int] = []
        self.rng: dict = {}

    def on_step_end(self, ctx: StepContext) -> None:
        if ctx.step in self.steps:
            self.sent.append(ctx.step)
            self.rng = rng_state_of()
            os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class Stop:
    """What the interrupted session held when it stopped at `step`."""

    step: int
    parameters: dict
    optimizer: dict
    scheduler_epoch: int
    rng: dict


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[str, str]:
    return write_small_corpus(tmp_path_factory.mktemp("corpus"), num_docs=22)


def overrides_for(corpus: tuple[str, str], run_dir: Path, extra: list[str]) -> list[str]:
    return tiny_run(
        run_dir, corpus, f"--train.max_steps={MAX_STEPS}", "--train.deterministic=true", *extra
    )


def run_uninterrupted(overrides: list[str]) -> TrainingSession:
    session = make_session(overrides)
    draw_from_every_generator()  # as run_with_sigterms does
    with session.tracker:
        step, _ = run_training_loop(session)
    assert step == MAX_STEPS
    return session


def run_until_sigterm(session: TrainingSession, start: int, tokens: int, stop_at: int) -> Stop:
    """Run the loop under the real ShutdownHandler until a SIGTERM at `stop_at` stops it."""
    hook = SigtermAtSteps({stop_at})
    session.hooks.add(hook)
    with session.shutdown_handler:
        step, _ = run_training_loop(session, step=start, tokens_seen=tokens)
    assert hook.sent == [stop_at]
    assert session.shutdown_handler.signals_received == ("SIGTERM",)
    assert step == stop_at, "the loop did not stop at the step boundary of the signal"
    run_dir = session.config.run_dir
    assert [e["step"] for e in events(run_dir, "shutdown")][-1] == stop_at
    assert events(run_dir, "shutdown")[-1]["signal"] == "SIGTERM"
    saved = [e["step"] for e in events(run_dir, "checkpoint")]
    assert saved.count(stop_at) == 1, f"step {stop_at} saved {saved.count(stop_at)} times"
    assert session.checkpointer.find_resume_path().endswith(f"step_{stop_at}")
    return Stop(
        step=stop_at,
        parameters=parameters_of(session.model),
        optimizer=optimizer_state_of(session.optimizer),
        scheduler_epoch=session.scheduler.last_epoch,
        rng=hook.rng,
    )


def resume_fresh(overrides: list[str], stop: Stop) -> tuple[TrainingSession, int, int]:
    """A new session on the same run dir, resumed; checks it holds exactly what was saved."""
    session = make_session(overrides)
    step, tokens = resume_session(session)
    assert step == stop.step
    assert_tensors_bitwise_equal(parameters_of(session.model), stop.parameters, "parameter")
    assert_optimizer_states_bitwise_equal(optimizer_state_of(session.optimizer), stop.optimizer)
    assert session.scheduler.last_epoch == stop.scheduler_epoch
    assert rng_state_of() == stop.rng, "the generators do not continue where the stop left them"
    return session, step, tokens


def run_with_sigterms(
    overrides: list[str], stops: list[int], resume_extra: list[str] | None = None
) -> TrainingSession:
    """Run to MAX_STEPS, stopped by SIGTERM at each of `stops` and resumed in a new session.

    The resumed sessions get `resume_extra` on top of `overrides`.
    """
    step, tokens = 0, 0
    session = make_session(overrides)
    # The tiny model draws no random numbers: draw some, so that a resume which left the
    # generators at their freshly seeded states would be caught.
    draw_from_every_generator()
    for stop_at in stops:
        with session.tracker:
            stop = run_until_sigterm(session, step, tokens, stop_at)
        session, step, tokens = resume_fresh(overrides + (resume_extra or []), stop)
    with session.tracker:
        final, _ = run_training_loop(session, step=step, tokens_seen=tokens)
    assert final == MAX_STEPS
    return session


def assert_same_run(got: TrainingSession, expected: TrainingSession, after: int) -> None:
    """Per-step rows after `after` and the final parameters are bitwise equal."""
    want = train_rows(expected.config.run_dir)
    have = train_rows(got.config.run_dir)
    assert [r["step"] for r in have] == list(range(1, MAX_STEPS + 1)), "steps lost or redone"
    for key in ("loss", "grad_norm", "lr", "tokens_seen"):
        tail = [(r["step"], r[key]) for r in have if r["step"] > after]
        assert tail == [(r["step"], r[key]) for r in want if r["step"] > after], key
    assert_tensors_bitwise_equal(
        parameters_of(got.model), parameters_of(expected.model), "final parameter"
    )


def _epoch_end(offset: int) -> int:
    return BATCHES_PER_EPOCH + offset


CASES = [
    pytest.param([], 1, id="k1"),
    pytest.param([], 3, id="k3"),
    pytest.param([], 6, id="k6-second-epoch"),
    pytest.param([], _epoch_end(-1), id="k4-before-epoch-end"),
    pytest.param([], _epoch_end(0), id="k5-at-epoch-end"),
    # 2 batches a step: step 3 reads the last batch of epoch 0 and the first of epoch 1.
    pytest.param(["--train.grad_accum_steps=2"], 2, id="accum2-k2-next-step-spans-epochs"),
    # 5 steps of 2 batches end exactly at the end of epoch 1.
    pytest.param(["--train.grad_accum_steps=2"], 5, id="accum2-k5-at-epoch-end"),
    pytest.param(["--eval.interval=3", "--eval.steps=2"], 3, id="k3-just-after-eval"),
    pytest.param(["--data.num_workers=2"], 3, id="workers2-k3"),
    pytest.param(["--data.num_workers=2"], _epoch_end(0), id="workers2-k5-at-epoch-end"),
    pytest.param(
        ["--data.num_workers=2", "--train.grad_accum_steps=2"], 2, id="workers2-accum2-k2"
    ),
    # The signal's step is also a scheduled save: saved once, then stopped.
    pytest.param(["--checkpoint.interval=3"], 3, id="k3-on-a-scheduled-save"),
    pytest.param(
        ["--checkpoint.async_mode=async", "--checkpoint.interval=2"], 3, id="async-saves-k3"
    ),
]


def test_corpus_has_the_epoch_length_the_cases_assume(corpus, tmp_path):
    session = make_session(overrides_for(corpus, tmp_path / "run", []))
    assert len(session.data.dataloader) == BATCHES_PER_EPOCH


@pytest.mark.parametrize(("extra", "stop_at"), CASES)
def test_sigterm_resume_matches_uninterrupted_run(corpus, tmp_path, extra, stop_at):
    expected = run_uninterrupted(overrides_for(corpus, tmp_path / "full", extra))
    got = run_with_sigterms(overrides_for(corpus, tmp_path / "split", extra), [stop_at])
    assert_same_run(got, expected, after=stop_at)
    want = [(r["step"], r["eval_loss"]) for r in eval_rows(expected.config.run_dir)]
    assert [(r["step"], r["eval_loss"]) for r in eval_rows(got.config.run_dir)] == want
    assert [s for s, _ in want] == ([3, 6] if "--eval.interval=3" in extra else [])


@pytest.mark.parametrize(
    ("extra", "stops"),
    [
        pytest.param([], [2, 5], id="k2-then-k5-at-epoch-end"),
        pytest.param(["--train.grad_accum_steps=2"], [1, 4], id="accum2-k1-then-k4"),
    ],
)
def test_resuming_twice_matches_uninterrupted_run(corpus, tmp_path, extra, stops):
    expected = run_uninterrupted(overrides_for(corpus, tmp_path / "full", extra))
    got = run_with_sigterms(overrides_for(corpus, tmp_path / "split", extra), stops)
    assert_same_run(got, expected, after=stops[0])
    resumes = events(got.config.run_dir, "resume")
    assert [e["step"] for e in resumes] == stops


@pytest.mark.parametrize(
    ("saved_with", "resumed_with", "stop_at"),
    [
        pytest.param(0, 2, 3, id="workers0-to-2-k3"),
        pytest.param(2, 0, _epoch_end(0), id="workers2-to-0-k5-at-epoch-end"),
    ],
)
def test_resume_with_another_worker_count_matches_uninterrupted_run(
    corpus, tmp_path, saved_with, resumed_with, stop_at
):
    expected = run_uninterrupted(overrides_for(corpus, tmp_path / "full", []))
    saving = overrides_for(corpus, tmp_path / "split", [f"--data.num_workers={saved_with}"])
    got = run_with_sigterms(saving, [stop_at], [f"--data.num_workers={resumed_with}"])
    assert got.data.dataloader.num_workers == resumed_with
    assert_same_run(got, expected, after=stop_at)


@pytest.fixture(scope="module")
def sharded_corpus(tmp_path_factory) -> tuple[str, str]:
    """The documents of `corpus`, prepared as three shards by three prepare-data calls."""
    return write_small_corpus(tmp_path_factory.mktemp("sharded"), num_docs=22, num_shards=3)


def test_a_sharded_corpus_trains_and_resumes_as_its_unsharded_twin(
    corpus, sharded_corpus, tmp_path
):
    extra = ["--data.num_workers=2", "--eval.interval=3", "--eval.steps=2"]
    expected = run_uninterrupted(overrides_for(corpus, tmp_path / "full", extra))
    got = run_with_sigterms(overrides_for(sharded_corpus, tmp_path / "split", extra), [4])
    assert_same_run(got, expected, after=0)  # every step, before the stop and after it
    want = [(r["step"], r["eval_loss"]) for r in eval_rows(expected.config.run_dir)]
    assert [(r["step"], r["eval_loss"]) for r in eval_rows(got.config.run_dir)] == want
    assert got.data.dataset is not None and got.data.dataset.meta["num_shards"] == 3


def test_first_row_after_a_resume_averages_every_step_since_the_previous_row(corpus, tmp_path):
    every_step = run_uninterrupted(overrides_for(corpus, tmp_path / "full", []))
    loss = {r["step"]: r["loss"] for r in train_rows(every_step.config.run_dir)}
    overrides = overrides_for(corpus, tmp_path / "split", ["--metrics.log_interval=2"])
    got = run_with_sigterms(overrides, [3])  # 3 is not a log step
    previous = 0
    for row in train_rows(got.config.run_dir):
        covered = [loss[s] for s in range(previous + 1, row["step"] + 1)]
        # The documented contract: loss_avg is the mean loss over the steps since the
        # previous row of metrics.jsonl, which a resumed run continues.
        assert row["loss_avg"] == pytest.approx(sum(covered) / len(covered), rel=1e-12), row
        previous = row["step"]


MOE = [
    "--model.num_experts=4",
    "--model.moe_top_k=2",
    "--model.moe_expert_hidden_dim=16",
    "--model.moe_shared_experts=1",
]


def router_state(session: TrainingSession) -> dict[str, object]:
    """The sigmoid routers' balancing biases: buffers, which parameters_of does not hold."""
    return {
        name: buffer.clone()
        for name, buffer in session.model.named_buffers()
        if name.endswith("expert_bias")
    }


@pytest.mark.parametrize(
    ("extra", "stop_at"),
    [
        pytest.param(
            ["--model.moe_router=sigmoid", "--model.moe_bias_update_rate=0.01"], 3, id="sigmoid-k3"
        ),
        pytest.param(
            [
                "--model.moe_router=sigmoid",
                "--model.moe_bias_schedule=cosine_decay",
                "--train.grad_accum_steps=2",
            ],
            2,
            id="sigmoid-cosine-accum2-k2",
        ),
        pytest.param(
            ["--model.moe_capacity_factor=1.0", "--model.moe_router_z_loss_weight=0.01"],
            4,
            id="softmax-capacity-k4",
        ),
    ],
)
def test_moe_resume_matches_uninterrupted_run_with_router_biases(corpus, tmp_path, extra, stop_at):
    expected = run_uninterrupted(overrides_for(corpus, tmp_path / "full", MOE + extra))
    got = run_with_sigterms(overrides_for(corpus, tmp_path / "split", MOE + extra), [stop_at])
    assert_same_run(got, expected, after=stop_at)
    want, have = router_state(expected), router_state(got)
    assert_tensors_bitwise_equal(have, want, "router bias")
    if "--model.moe_router=sigmoid" in extra:
        assert want and any(bool(b.abs().sum() > 0) for b in want.values())
    rows = {r["step"]: r for r in train_rows(got.config.run_dir)}
    want_rows = {r["step"]: r for r in train_rows(expected.config.run_dir)}
    for step in range(stop_at + 1, MAX_STEPS + 1):
        for key in ("moe/aux_loss", "moe/z_loss", "moe/load", "moe/dropped_share"):
            assert rows[step][key] == want_rows[step][key], (step, key)


def new_children(before: list[multiprocessing.process.BaseProcess]):
    """Child processes started since ``before`` was taken (other tests may leave some)."""
    return [p for p in multiprocessing.active_children() if p not in before]


class LoaderWorkersSeen(TrainingHook):
    """Notes the loader worker processes alive at the end of the first step."""

    def __init__(self) -> None:
        self.before = multiprocessing.active_children()
        self.workers: list[multiprocessing.process.BaseProcess] = []

    def on_step_end(self, ctx: StepContext) -> None:
        if not self.workers:
            self.workers = new_children(self.before)


def test_the_loop_stops_its_loader_workers_when_it_returns(corpus, tmp_path):
    session = make_session(overrides_for(corpus, tmp_path / "run", ["--data.num_workers=2"]))
    seen = LoaderWorkersSeen()
    session.hooks.add(seen)
    with session.tracker:
        run_training_loop(session)
    assert len(seen.workers) == 2
    # Stopped on return, while the session is still referenced: not left to the collector.
    assert [w.is_alive() for w in seen.workers] == [False, False]


def test_a_reset_stream_stops_its_workers_and_continues_at_the_next_batch(corpus, tmp_path):
    overrides = overrides_for(corpus, tmp_path / "run", ["--data.num_workers=2"])
    straight = make_session(overrides)
    want = [straight.batches.next_batch()["input_ids"] for _ in range(3)]
    straight.batches.reset()
    session = make_session(overrides)
    before = multiprocessing.active_children()
    got = [session.batches.next_batch()["input_ids"] for _ in range(2)]
    workers = new_children(before)
    assert len(workers) == 2
    session.batches.reset()
    assert [w.is_alive() for w in workers] == [False, False]
    got.append(session.batches.next_batch()["input_ids"])
    session.batches.reset()
    assert_tensors_bitwise_equal(
        {str(i): t for i, t in enumerate(got)}, {str(i): t for i, t in enumerate(want)}, "batch"
    )
