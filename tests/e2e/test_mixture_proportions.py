"""Mixture proportions through the real training loop: weights, temperature, phases, sums.

Each run trains a tiny model in-process (load_config -> validate -> build_session ->
run_training_loop) on byte-tokenized sources whose alphabets are disjoint, so every
window's source can be read off its tokens. Three independent views of which source each
row came from are compared: the ``tokens/<name>`` of the metrics rows, the StepResult the
step body returned, and the tokens the model was actually fed (a forward pre-hook).

Tolerances. The sampler gives a source with probability p its exact share of every epoch
and of every chunk of 1,024 positions, at places a keyed permutation picks, so over n
windows its count is n p give or take what a window range cuts out of an epoch or chunk: a
hypergeometric spread, narrower than Binomial(n, p)'s sqrt(n p (1 - p)). A share is
accepted within ``SIGMAS = 4`` of that binomial deviation, a generous bound. Everything is
seeded from train.seed, so each test draws the same windows on every run: it either
always passes or always fails, never flakes.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import StepResult, TrainingSession, run_training_loop
from tests.support.metrics_rows import train_rows
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

SIGMAS = 4.0
SEQ_LEN = 16
BATCH = 8
ALPHABETS = {"lower": "abcdefgh", "digits": "0123456789", "upper": "QRSTUVWXYZ"}
"""Each source's documents use only these bytes (plus the space), disjoint across sources."""


@pytest.fixture(scope="module")
def source_dirs(tmp_path_factory) -> dict[str, str]:
    """name -> prepared directory of ~200 windows of SEQ_LEN + 1 tokens, one per alphabet."""
    root = tmp_path_factory.mktemp("proportions")
    rng = random.Random(0)
    dirs = {}
    for name, alphabet in ALPHABETS.items():
        source = root / f"{name}.jsonl"
        with open(source, "w") as f:
            for _ in range(120):
                words = ("".join(rng.choices(alphabet, k=rng.randint(2, 6))) for _ in range(6))
                f.write(json.dumps({"text": " ".join(words)}) + "\n")
        dirs[name] = str(root / name)
        prepare_data([str(source)], dirs[name], ByteTokenizer())
    return dirs


@dataclasses.dataclass
class MixtureRun:
    """What one training run reported, step by step (index k is step k + 1)."""

    names: list[str]
    rows: list[dict]  # the metrics.jsonl training rows
    results: list[StepResult]  # what the step body returned
    fed: list[dict[str, int]]  # windows per source among the model's inputs, by content

    def windows(self, steps: range | None = None) -> dict[str, int]:
        """Windows drawn per source over ``steps`` (1-based; default all), from the rows."""
        steps = steps or range(1, len(self.rows) + 1)
        return {
            name: sum(self.rows[s - 1][f"tokens/{name}"] for s in steps) // SEQ_LEN
            for name in self.names
        }


def _source_of(row: torch.Tensor) -> str:
    """The alphabet a window's text bytes come from (special ids and spaces ignored)."""
    text = {chr(int(t)) for t in row if int(t) < 256} - {" "}
    owners = [name for name, alphabet in ALPHABETS.items() if text <= set(alphabet)]
    assert len(owners) == 1, f"window bytes {sorted(text)} match sources {owners}"
    return owners[0]


def train_mixture(
    run_dir: Path,
    source_dirs: dict[str, str],
    weights: dict[str, float],
    *,
    steps: int,
    temperature: float = 1.0,
    phases: str = "",
    extra: tuple[str, ...] = (),
) -> MixtureRun:
    """Train ``steps`` steps on the named sources with these weights, recording each step."""
    datasets = ", ".join(
        f'{{name = "{n}", path = "{source_dirs[n]}", weight = {w}}}' for n, w in weights.items()
    )
    overrides = tiny_run(
        run_dir,
        None,
        f"--train.batch_size={BATCH}",
        f"--train.seq_len={SEQ_LEN}",
        f"--train.max_steps={steps}",
        "--train.seed=11",
        "--scheduler.name=constant",
        "--scheduler.warmup_steps=0",
        f"--data.datasets=[{datasets}]",
        f"--data.mix_temperature={temperature}",
        *([f"--train.phases={phases}"] if phases else []),
        *extra,
    )
    config = load_config(None, overrides)
    config.validate(1)
    session: TrainingSession = build_session(config, RuntimeContext())
    results: list[StepResult] = []
    fed: list[dict[str, int]] = []
    body = session.step_fn

    def recording_step(s: TrainingSession, step: int) -> StepResult:
        fed.append(dict.fromkeys(weights, 0))
        result = body(s, step)
        results.append(result)
        return result

    def count_inputs(module: torch.nn.Module, args: tuple) -> None:
        for row in args[0]:
            fed[-1][_source_of(row)] += 1

    session.step_fn = recording_step
    handle = session.model.register_forward_pre_hook(count_inputs)
    try:
        with session.tracker:
            run_training_loop(session)
    finally:
        handle.remove()
    rows = train_rows(config.run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert len(results) == steps  # no step was skipped
    return MixtureRun(list(weights), rows, results, fed)


def expected_probabilities(weights: dict[str, float], temperature: float) -> dict[str, float]:
    """w_i ** (1 / T) normalised, computed here rather than by the library."""
    scaled = {n: w ** (1.0 / temperature) if w > 0 else 0.0 for n, w in weights.items()}
    total = sum(scaled.values())
    return {n: s / total for n, s in scaled.items()}


def assert_shares_match(counts: dict[str, int], probabilities: dict[str, float]) -> None:
    """Every source's count within SIGMAS binomial standard deviations of n * p."""
    n = sum(counts.values())
    for name, p in probabilities.items():
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[name] - n * p) <= SIGMAS * sd, (
            f"{name}: {counts[name]} of {n} windows, expected {n * p:.1f} +- {SIGMAS * sd:.1f} "
            f"(p = {p:.4f}); all counts {counts}"
        )


def assert_attribution_matches_content(run: MixtureRun) -> None:
    """tokens/<name> counts exactly the windows the model was fed from that source."""
    for k, (row, fed) in enumerate(zip(run.rows, run.fed, strict=True)):
        assert {n: row[f"tokens/{n}"] // SEQ_LEN for n in run.names} == fed, f"step {k + 1}"


def test_three_sources_are_drawn_in_proportion_to_their_weights(tmp_path, source_dirs):
    weights = {"lower": 5.0, "digits": 3.0, "upper": 2.0}  # p = 0.5, 0.3, 0.2
    run = train_mixture(tmp_path / "run", source_dirs, weights, steps=150)
    counts = run.windows()
    assert sum(counts.values()) == 150 * BATCH
    assert_shares_match(counts, expected_probabilities(weights, 1.0))
    assert_attribution_matches_content(run)


def test_temperature_flattens_and_sharpens_the_mixture(tmp_path, source_dirs):
    weights = {"lower": 3.0, "digits": 1.0}
    shares = {}
    for temperature in (0.5, 1.0, 2.0):
        run = train_mixture(
            tmp_path / f"t{temperature}", source_dirs, weights, steps=150, temperature=temperature
        )
        expected = expected_probabilities(weights, temperature)
        counts = run.windows()
        assert_shares_match(counts, expected)
        shares[temperature] = counts["lower"] / sum(counts.values())
    # The documented values for 3:1 (docs/data.md): 0.9, 0.75, sqrt(3) / (sqrt(3) + 1).
    assert expected_probabilities(weights, 0.5)["lower"] == pytest.approx(0.9)
    assert expected_probabilities(weights, 2.0)["lower"] == pytest.approx(0.634, abs=5e-4)
    # Sharper (T < 1) favours the heavy source more, flatter (T > 1) less.
    assert shares[0.5] > shares[1.0] > shares[2.0] > 0.5


def test_phases_switch_the_proportions_from_the_step_after_start_step(tmp_path, source_dirs):
    """Three segments, each matching its own weights. The second phase names only digits,
    so lower and upper keep what the first phase set (the weights in force), not their
    configured 3 and 0: 1:0:2 rather than 3:0:0."""
    weights = {"lower": 3.0, "digits": 1.0, "upper": 0.0}
    phases = (
        "[{start_step = 80, dataset_weights = {lower = 1.0, upper = 2.0}},"
        " {start_step = 140, dataset_weights = {digits = 0.0}}]"
    )
    run = train_mixture(tmp_path / "run", source_dirs, weights, steps=200, phases=phases)
    first, second = weights, {**weights, "lower": 1.0, "upper": 2.0}
    third = {**second, "digits": 0.0}
    segments = [(range(1, 81), first), (range(81, 141), second), (range(141, 201), third)]
    for steps, segment_weights in segments:
        counts = run.windows(steps)
        assert_shares_match(counts, expected_probabilities(segment_weights, 1.0))
        for name, weight in segment_weights.items():
            assert (counts[name] == 0) == (weight == 0), (steps, name, counts)
    # Steps 81 and 141, the first after each start_step, already draw with the new weights.
    assert run.fed[80]["upper"] > 0 and run.fed[140]["digits"] == 0
    assert_attribution_matches_content(run)


def test_per_dataset_tokens_and_losses_add_up_to_the_step(tmp_path, source_dirs):
    """tokens/<name> are input tokens (SEQ_LEN per row) and sum to the step's tokens;
    loss/<name> are per-source means over supervised labels, so weighted by the supervised
    counts (not by tokens/<name>) they average to the step's loss. Document masking makes
    the two counts differ; two micro-batches per step check the sums span them."""
    weights = {"lower": 2.0, "digits": 1.0, "upper": 1.0}
    run = train_mixture(
        tmp_path / "run", source_dirs, weights, steps=12, extra=("--train.grad_accum_steps=2",)
    )
    previous = 0
    for row, result in zip(run.rows, run.results, strict=True):
        step_tokens = row["tokens_seen"] - previous
        previous = row["tokens_seen"]
        assert step_tokens == 2 * BATCH * SEQ_LEN
        assert sum(row[f"tokens/{n}"] for n in run.names) == step_tokens
        assert result.dataset_token_counts == {n: row[f"tokens/{n}"] for n in run.names}
        counts = result.dataset_loss_counts
        assert all(counts[n] <= row[f"tokens/{n}"] for n in run.names)
        supervised = sum(counts.values())
        assert supervised < step_tokens  # labels after an EOS are ignored
        present = [n for n in run.names if counts[n]]
        for n in run.names:
            if counts[n]:
                assert row[f"loss/{n}"] == pytest.approx(result.dataset_loss_sums[n] / counts[n])
            else:
                assert row[f"loss/{n}"] is None  # NaN, written as null
        weighted = sum(row[f"loss/{n}"] * counts[n] for n in present) / supervised
        assert weighted == pytest.approx(row["loss"], rel=1e-5)
        assert row["loss"] == pytest.approx(result.loss, rel=1e-12)
