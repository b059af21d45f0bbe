"""End to end: train a tiny model 4 steps, then `kempnerforge eval` its checkpoint."""

from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from tests.support.cli import run_kempnerforge
from tests.support.metrics_rows import read_rows
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")


def kempnerforge(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run_kempnerforge(*args, env_extra={"OMP_NUM_THREADS": "1"}, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, token_dirs) -> pathlib.Path:
    """The run directory of a 4-step tiny run that evaluated and saved at step 4."""
    run_dir = tmp_path_factory.mktemp("eval_cli") / "run"
    result = kempnerforge(
        "train",
        DEBUG,
        *tiny_run(
            run_dir,
            token_dirs,
            "--model.n_kv_heads=2",
            "--train.max_steps=4",
            "--checkpoint.interval=4",
            "--eval.interval=4",
            "--eval.steps=3",
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def test_eval_of_a_checkpoint_matches_the_eval_the_run_logged(trained, tmp_path):
    (logged,) = [r for r in read_rows(trained) if "eval_loss" in r]
    assert logged["step"] == 4
    checkpoint = trained / "checkpoints" / "step_4"
    result = kempnerforge("eval", str(trained / "config.toml"), f"--checkpoint={checkpoint}")
    assert result.returncode == 0, result.stderr[-3000:]
    header, row = result.stdout.splitlines()[:2]
    assert header.split() == ["set", "tokens", "loss", "perplexity"]
    assert row.split()[0] == "heldout"
    report = json.loads((checkpoint / "eval.json").read_text())
    assert report["step"] == 4
    assert set(report["metrics"]) == {"eval_loss", "eval_ppl", "eval_tokens"}
    assert report["metrics"]["eval_loss"] == pytest.approx(logged["eval_loss"], abs=1e-6)
    assert report["metrics"]["eval_tokens"] == logged["eval_tokens"]


def test_eval_on_named_sets_with_steps_and_output(trained, tmp_path, token_dirs):
    train, evald = token_dirs
    sets = f'--eval.sets=[{{name = "a", path = "{evald}"}}, {{name = "b", path = "{train}"}}]'
    output = tmp_path / "out" / "metrics.json"
    result = kempnerforge(
        "eval",
        str(trained / "config.toml"),
        f"--checkpoint={trained / 'checkpoints' / 'step_4'}",
        f"--output={output}",
        "--steps=1",
        sets,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [line.split()[0] for line in result.stdout.splitlines()[:4]] == ["set", "a", "b", "all"]
    report = json.loads(output.read_text())
    assert report["eval_steps"] == 1
    assert {"eval_loss/a", "eval_ppl/b", "eval_loss"} <= set(report["metrics"])


def test_a_bad_checkpoint_exits_1_and_a_bad_config_exits_2(trained, tmp_path):
    missing = tmp_path / "step_99"
    result = kempnerforge("eval", str(trained / "config.toml"), f"--checkpoint={missing}")
    assert result.returncode == 1
    assert str(missing) in result.stderr and "Traceback" not in result.stderr
    result = kempnerforge(
        "eval", str(trained / "config.toml"), f"--checkpoint={missing}", "--eval.stepz=1"
    )
    assert result.returncode == 2
    assert "eval.stepz" in result.stderr and "Traceback" not in result.stderr
