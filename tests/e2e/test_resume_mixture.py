"""A mixture with phases, stopped by a real SIGTERM and resumed, matches the uninterrupted run.

Three byte-tokenized sources with disjoint alphabets, 20 windows in all, make a mixture
epoch of exactly five batches, so eight steps cross an epoch boundary. Two phases change the
weights and the LR scale from steps 3 and 6: stops land before, at and inside phases, at the
epoch boundary, with workers, with gradient accumulation, and twice in one run. Besides the
per-step rows and final parameters, the resumed session must hold the phase and the sampler
weights the uninterrupted run held at the stop, and no phase may fire twice.
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kempnerforge.config.data import DataConfig, DatasetSourceConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.data.pipeline_build import build_data_pipeline
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.optim.scheduler import lr_factor
from kempnerforge.training.hooks import StepContext, TrainingHook
from kempnerforge.training.loop import TrainingSession, run_training_loop
from tests.e2e.test_resume_exact import MAX_STEPS, resume_fresh, run_until_sigterm
from tests.support.metrics_rows import events, train_rows
from tests.support.resume import (
    assert_tensors_bitwise_equal,
    draw_from_every_generator,
    make_session,
    parameters_of,
)
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

# MAX_STEPS (8) comes with the SIGTERM helpers: phases from steps 3 and 6 leave each phase
# at least two updates, and 8 steps of 4 windows cross the 5-batch mixture epoch.

SEQ_LEN = 32
BATCH = 4
WINDOWS = {"a": 8, "b": 6, "c": 6}  # 20 windows: a mixture epoch of exactly 5 batches
BATCHES_PER_EPOCH = sum(WINDOWS.values()) // BATCH
ALPHABETS = {"a": "abcdefgh", "b": "0123456789", "c": "QRSTUVWXYZ"}
NAMES = list(WINDOWS)
WEIGHTS = {"a": 3.0, "b": 1.0, "c": 1.0}
TEMPERATURE = 2.0
PHASE_STEPS = (3, 6)
PHASES = (
    "[{start_step=3, lr_scale=0.5, dataset_weights={a=0.0, b=4.0}},"
    " {start_step=6, lr_scale=0.25, dataset_weights={a=4.0, c=0.0}}]"
)
WEIGHTS_FROM = {  # start step -> the weights in force from then on
    0: [3.0, 1.0, 1.0],
    3: [0.0, 4.0, 1.0],
    6: [4.0, 4.0, 0.0],
}
LR_SCALE_FROM = {0: 1.0, 3: 0.5, 6: 0.25}
ROW_KEYS = (
    "loss",
    "grad_norm",
    "lr",
    "tokens_seen",
    *(f"loss/{n}" for n in NAMES),
    *(f"tokens/{n}" for n in NAMES),
)


def _phase_start(step: int) -> int:
    """The start step of the phase in force once `step` steps are done (0: none yet)."""
    return max(s for s in (0, *PHASE_STEPS) if s <= step)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    """name -> prepared dir, plus "eval"; every document is exactly one window of 33 tokens."""
    root = tmp_path_factory.mktemp("mixture")
    dirs = {}
    for name, alphabet in ALPHABETS.items():
        path = root / f"{name}.jsonl"
        with open(path, "w") as f:
            for i in range(WINDOWS[name]):
                # SEQ_LEN bytes + EOS = one window; the rotation makes each document differ.
                text = (alphabet[i % len(alphabet) :] + alphabet) * SEQ_LEN
                f.write(json.dumps({"text": text[:SEQ_LEN]}) + "\n")
        dirs[name] = str(root / name)
        prepare_data([str(path)], dirs[name], ByteTokenizer())
    path = root / "eval.jsonl"
    with open(path, "w") as f:
        for alphabet in ALPHABETS.values():
            f.write(json.dumps({"text": (alphabet * SEQ_LEN)[:SEQ_LEN]}) + "\n")
    dirs["eval"] = str(root / "eval")
    prepare_data([str(path)], dirs["eval"], ByteTokenizer())
    return dirs


def overrides_for(sources: dict[str, str], run_dir: Path, extra: list[str]) -> list[str]:
    datasets = ", ".join(f'{{name="{n}", path="{sources[n]}", weight={WEIGHTS[n]}}}' for n in NAMES)
    return tiny_run(
        run_dir,
        None,
        f"--train.batch_size={BATCH}",
        f"--train.seq_len={SEQ_LEN}",
        f"--train.max_steps={MAX_STEPS}",
        "--train.deterministic=true",
        "--scheduler.name=cosine",
        "--data.path=",
        f"--data.datasets=[{datasets}]",
        f"--data.mix_temperature={TEMPERATURE}",
        f"--data.eval_path={sources['eval']}",
        f"--train.phases={PHASES}",
        *extra,
    )


@dataclass(frozen=True)
class MixtureState:
    """The phase and mixture weights a session holds between two steps."""

    next_phase: int
    lr_scale: float
    current_start: int | None
    weights: tuple[float, ...]


def mixture_state_of(session: TrainingSession) -> MixtureState:
    phases = session.phases
    return MixtureState(
        next_phase=phases.next_index,
        lr_scale=phases.lr_scale,
        current_start=phases.current.start_step if phases.current else None,
        weights=tuple(session.data.sampler.weights),
    )


class RecordMixtureState(TrainingHook):
    """Notes the session's MixtureState at the end of every step (phases due there fired)."""

    def __init__(self, session: TrainingSession) -> None:
        # A weak reference: a session <-> hook cycle would leave the loader's workers to the
        # cyclic collector, whose shutdown of them stalls for seconds.
        self.session = weakref.ref(session)
        self.at: dict[int, MixtureState] = {}

    def on_step_end(self, ctx: StepContext) -> None:
        session = self.session()
        assert session is not None
        self.at[ctx.step] = mixture_state_of(session)


@dataclass
class Reference:
    """What the uninterrupted run logged, ended with, and held after each step."""

    config: JobConfig
    rows: list[dict]
    parameters: dict
    states: dict[int, MixtureState]


@pytest.fixture(scope="module")
def reference_for(sources, tmp_path_factory):
    """extra overrides -> the uninterrupted run, run once per module for each."""
    cache: dict[tuple[str, ...], Reference] = {}

    def get(extra: list[str]) -> Reference:
        key = tuple(extra)
        if key not in cache:
            run_dir = tmp_path_factory.mktemp("full") / "run"
            session = make_session(overrides_for(sources, run_dir, extra))
            recorder = RecordMixtureState(session)
            session.hooks.add(recorder)
            draw_from_every_generator()  # as run_mixture_with_sigterms does
            with session.tracker:
                step, _ = run_training_loop(session)
            assert step == MAX_STEPS
            cache[key] = Reference(
                config=session.config,
                rows=train_rows(str(run_dir)),
                parameters=parameters_of(session.model),
                states=recorder.at,
            )
        return cache[key]

    return get


def run_mixture_with_sigterms(
    overrides: list[str], stops: list[int], reference: Reference
) -> TrainingSession:
    """Run to MAX_STEPS, stopped by SIGTERM at each of `stops` and resumed in a new session.

    After each resume the session must hold the phase and sampler weights the uninterrupted
    run held at that step: a phase that fired at the stop must not be lost or fire again.
    """
    step, tokens = 0, 0
    session = make_session(overrides)
    draw_from_every_generator()  # see tests/e2e/test_resume_exact.py::run_with_sigterms
    for stop_at in stops:
        with session.tracker:
            stop = run_until_sigterm(session, step, tokens, stop_at)
        assert mixture_state_of(session) == reference.states[stop_at], "before the save"
        session, step, tokens = resume_fresh(overrides, stop)
        assert mixture_state_of(session) == reference.states[stop_at], f"resumed at {stop_at}"
    with session.tracker:
        final, _ = run_training_loop(session, step=step, tokens_seen=tokens)
    assert final == MAX_STEPS
    return session


def assert_same_mixture_run(got: TrainingSession, reference: Reference, after: int) -> None:
    """Rows after `after` (per-dataset keys included) and final parameters bitwise equal;
    each phase fired exactly once over the whole split run."""
    rows = train_rows(got.config.run_dir)
    assert [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1)), "steps lost or redone"
    for key in ROW_KEYS:
        have = [(r["step"], r[key]) for r in rows if r["step"] > after]
        want = [(r["step"], r[key]) for r in reference.rows if r["step"] > after]
        assert have == want, key
    assert_tensors_bitwise_equal(parameters_of(got.model), reference.parameters, "final parameter")
    fired = [(e["step"], e["start_step"]) for e in events(got.config.run_dir, "phase")]
    assert fired == [(s, s) for s in PHASE_STEPS], "a phase was lost or fired again"


def test_sources_have_the_epoch_length_the_cases_assume(sources, tmp_path):
    session = make_session(overrides_for(sources, tmp_path / "run", []))
    assert session.data.dataset.sizes == list(WINDOWS.values())
    assert len(session.data.dataloader) == BATCHES_PER_EPOCH == 5
    assert session.data.dataset_names == NAMES


def test_the_phases_change_the_data_and_the_lr_of_the_uninterrupted_run(reference_for):
    """Without this, bitwise equality could hold over phases that did nothing."""
    reference = reference_for([])
    for step in range(1, MAX_STEPS + 1):
        state = reference.states[step]
        start = _phase_start(step)
        assert state.weights == tuple(WEIGHTS_FROM[start]), step
        assert state.lr_scale == LR_SCALE_FROM[start], step
        assert state.current_start == (start or None), step
    rows = {r["step"]: r for r in reference.rows}
    config = reference.config
    for step, row in rows.items():
        # Row `step` is update `step`: it uses the scale of the phase in force after step - 1.
        scale = LR_SCALE_FROM[_phase_start(step - 1)]
        factor = lr_factor(step - 1, config.scheduler, config.train.max_steps)
        assert row["lr"] == pytest.approx(config.optimizer.lr * factor * scale), step
        assert sum(row[f"tokens/{n}"] for n in NAMES) == BATCH * SEQ_LEN
    # Updates 4-6 use the weights from step 3 (a = 0); updates 7-8 those from step 6 (c = 0).
    assert all(rows[s]["tokens/a"] == 0 and rows[s]["loss/a"] is None for s in (4, 5, 6))
    assert all(rows[s]["tokens/c"] == 0 and rows[s]["loss/c"] is None for s in (7, 8))
    assert sum(rows[s]["tokens/a"] for s in (1, 2, 3)) > 0
    assert sum(rows[s]["tokens/a"] for s in (7, 8)) > 0
    assert sum(rows[s]["tokens/c"] for s in range(1, 7)) > 0


CASES = [
    pytest.param([], [2], id="k2-before-first-phase"),
    pytest.param([], [3], id="k3-at-first-phase-start"),
    pytest.param([], [4], id="k4-inside-phase-2-next-step-spans-epochs"),
    pytest.param([], [BATCHES_PER_EPOCH], id="k5-inside-phase-2-at-epoch-end"),
    pytest.param([], [6], id="k6-at-second-phase-start"),
    pytest.param([], [7], id="k7-inside-phase-3"),
    pytest.param(["--data.num_workers=2"], [3], id="workers2-k3-at-first-phase-start"),
    # 2 batches a step: step 3 reads the last batch of epoch 0 and the first of epoch 1, so
    # the phase fires inside epoch 1.
    pytest.param(["--train.grad_accum_steps=2"], [3], id="accum2-k3-at-first-phase-start"),
    pytest.param([], [2, 6], id="k2-then-k6-resumes-twice"),
]


@pytest.mark.parametrize(("extra", "stops"), CASES)
def test_sigterm_resume_of_a_phased_mixture_matches_uninterrupted_run(
    sources, reference_for, tmp_path, extra, stops
):
    reference = reference_for(extra)
    overrides = overrides_for(sources, tmp_path / "split", extra)
    got = run_mixture_with_sigterms(overrides, stops, reference)
    assert_same_mixture_run(got, reference, after=stops[0])
    assert [e["step"] for e in events(got.config.run_dir, "resume")] == stops


def _pipeline(sources: dict[str, str], num_workers: int):
    cfg = DataConfig(
        datasets=[DatasetSourceConfig(n, sources[n], WEIGHTS[n]) for n in NAMES],
        mix_temperature=TEMPERATURE,
        num_workers=num_workers,
    )
    return build_data_pipeline(cfg, seq_len=SEQ_LEN, batch_size=BATCH, seed=0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_weight_change_not_yet_drawn_survives_a_save_and_load(sources, num_workers):
    """What a phase firing at the step of a save leaves: set_weights, then the loop's reset,
    and no batch drawn since. The saved state must carry the change: after a resume the
    phase counts as fired and is not applied again."""
    pipe = _pipeline(sources, num_workers)
    next(iter(pipe.dataloader))
    pipe.set_weights({"a": 0.0, "b": 4.0})
    pipe.dataloader.load_state_dict(pipe.dataloader.state_dict())  # BatchStream.reset()
    state = pipe.state_dict()
    resumed = _pipeline(sources, num_workers)
    resumed.load_state_dict(state)
    assert resumed.sampler.weights == WEIGHTS_FROM[3]
    want, got = next(iter(pipe.dataloader)), next(iter(resumed.dataloader))
    assert all(torch.equal(want[k], got[k]) for k in want)
