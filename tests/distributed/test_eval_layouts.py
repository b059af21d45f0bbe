"""Eval in every layout evaluates the same windows: a two-rank run, with or without gradient
accumulation, logs the eval a single process logs at the same global batch, also when the
ranks do not divide the eval batch, and `kempnerforge eval` of its checkpoint in one
process gives that number again."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pytest

from kempnerforge.config.loader import load_config, save_config
from tests.support import warm_process
from tests.support.dist import run_distributed
from tests.support.metrics_rows import read_rows
from tests.support.tiny import layout_run
from tests.support.tolerance import layout_atol
from tests.support.train_run import train_on_ranks

pytestmark = pytest.mark.distributed

REPO = pathlib.Path(__file__).parents[2]
STEPS = 2
SEQ_LEN, EVAL_STEPS = 32, 3


@pytest.fixture(scope="module")
def base(token_dirs) -> list[str]:
    return layout_run(
        token_dirs,
        STEPS,
        f"--checkpoint.interval={STEPS}",
        f"--eval.interval={STEPS}",
        f"--eval.steps={EVAL_STEPS}",
        "--data.document_masking=false",
    )


def _logged_eval(run_dir: pathlib.Path) -> dict:
    (row,) = [r for r in read_rows(run_dir) if "eval_loss" in r]
    assert row["step"] == STEPS
    return row


def _train(base: list[str], run_dir: pathlib.Path, world_size: int, *extra: str) -> dict:
    """Train in ``world_size`` processes, keep the run's config.toml as the CLI would, and
    return the eval row it logged."""
    overrides = [*base, f"--train.run_dir={run_dir}", *extra]
    run_distributed(train_on_ranks, world_size, overrides, {})
    save_config(load_config(None, overrides), str(run_dir / "config.toml"))
    return _logged_eval(run_dir)


def _eval_atol(base: list[str], want: float, updates: int, batch: int = 4) -> float:
    """The eval loss's bound: fp32 reordering of the model's forward, of the EVAL_STEPS
    batches' tokens it averages, and of ``updates`` training steps that differ in layout
    (none between a run's logged eval and `kempnerforge eval` of its checkpoint: the same
    weights)."""
    model = load_config(None, base).model
    tokens = EVAL_STEPS * batch * SEQ_LEN
    return layout_atol(model, SEQ_LEN, tokens=tokens, updates=updates, magnitude=abs(want))


@pytest.fixture(scope="module")
def one_process(base, tmp_path_factory) -> dict:
    """One process, 4 sequences per step: the eval every layout must log."""
    return _train(base, tmp_path_factory.mktemp("one"), 1, "--train.batch_size=4")


@pytest.mark.parametrize(("per_rank", "accum"), [(2, 1), (1, 2)], ids=["fsdp", "accumulate"])
def test_two_ranks_evaluate_the_windows_one_process_does(
    base, one_process, tmp_path, per_rank, accum
):
    split = [f"--train.batch_size={per_rank}", f"--train.grad_accum_steps={accum}"]
    run = tmp_path / "run"
    logged = _train(base, run, 2, "--distributed.dp_shard=2", *split)
    assert logged["eval_tokens"] == one_process["eval_tokens"]
    want = one_process["eval_loss"]
    assert logged["eval_loss"] == pytest.approx(want, abs=_eval_atol(base, want, STEPS))
    # `kempnerforge eval` in one process takes the run's global batch from the checkpoint
    # (1 x 2 x 2 ranks for the accumulating run, though its config gives 1 x 2 alone).
    report = _standalone_eval(run)
    assert report["eval_batch_size"] == 4
    assert report["metrics"]["eval_tokens"] == logged["eval_tokens"]
    atol = _eval_atol(base, logged["eval_loss"], 0)
    assert report["metrics"]["eval_loss"] == pytest.approx(logged["eval_loss"], abs=atol)


def test_tensor_parallel_ranks_evaluate_like_one_process(base, one_process, tmp_path):
    """The eval loss under tp comes from the vocabulary-parallel chunked loss (no grad)."""
    layout = ["--distributed.tp=2", "--distributed.dp_shard=1", "--train.batch_size=4"]
    logged = _train(base, tmp_path / "run", 2, *layout)
    assert logged["eval_tokens"] == one_process["eval_tokens"]
    want = one_process["eval_loss"]
    assert logged["eval_loss"] == pytest.approx(want, abs=_eval_atol(base, want, STEPS))


def test_ranks_that_do_not_divide_the_eval_batch_evaluate_it_once(base, tmp_path):
    # 3 sequences per eval step on 2 ranks: shares of 2 and 1, the short one padded with a
    # window that counts nothing, so one process finds the same tokens and loss.
    run = tmp_path / "run"
    layout = ["--distributed.dp_shard=2", "--train.batch_size=2", "--eval.batch_size=3"]
    logged = _train(base, run, 2, *layout)
    report = _standalone_eval(run)
    assert report["eval_batch_size"] == 3
    assert report["metrics"]["eval_tokens"] == logged["eval_tokens"]
    atol = _eval_atol(base, logged["eval_loss"], 0, batch=3)
    assert report["metrics"]["eval_loss"] == pytest.approx(logged["eval_loss"], abs=atol)


def _standalone_eval(run: pathlib.Path) -> dict:
    """`kempnerforge eval` of the run's last checkpoint in one process: its eval.json."""
    checkpoint = run / "checkpoints" / f"step_{STEPS}"
    result = warm_process.run(
        [
            sys.executable, "-m", "kempnerforge", "eval", str(run / "config.toml"),
            f"--checkpoint={checkpoint}", "--distributed.dp_shard=-1",
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((checkpoint / "eval.json").read_text())
