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


def _task_files(directory: pathlib.Path) -> str:
    """An --eval.tasks override: a 3-question multiple-choice file and a bits-per-byte
    text file."""
    questions = [
        {"context": "def f(x):\n    return", "choices": [" x", " ]]]"], "gold": 0},
        {"context": "import", "choices": [" os", " )))"], "gold": 0},
        {"context": "for i in", "choices": [" range(3):", " ;;;"], "gold": 0},
    ]
    mc = directory / "mc.jsonl"
    mc.write_text("".join(json.dumps(q) + "\n" for q in questions))
    text = directory / "code.txt"
    text.write_text("def add(a, b):\n    return a + b\n")
    return (
        f'--eval.tasks=[{{name = "mc", path = "{mc}", interval = 2}}, '
        f'{{name = "code", path = "{text}", kind = "bits_per_byte"}}]'
    )


def test_tasks_are_scored_in_training_and_from_the_command_line(tmp_path, token_dirs):
    """The multiple-choice task at its own interval (2) and at the end, the bits-per-byte
    task at eval.interval (4); `eval --tasks` of the step-4 checkpoint scores them again
    in one process, and an unknown name is a one-line config error."""
    run_dir = tmp_path / "run"
    tasks = _task_files(tmp_path)
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
            "--eval.steps=1",
            tasks,
        ),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [r for r in read_rows(run_dir) if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in rows] == [2, 4]
    assert "eval/code/bpb" not in rows[0] and "eval_loss" not in rows[0]
    last = rows[1]
    assert last["eval/mc/examples"] == 3 and 0 <= last["eval/mc/acc"] <= 1
    # One token a byte, every byte scored but the first: the data has no BOS and training
    # masks documents, so nothing before a document's first token predicts it.
    assert last["eval/code/bytes"] == 32 and last["eval/code/tokens"] == 31
    checkpoint = run_dir / "checkpoints" / "step_4"
    config = str(run_dir / "config.toml")
    scored = kempnerforge("eval", config, f"--checkpoint={checkpoint}", "--tasks")
    assert scored.returncode == 0, scored.stderr[-3000:]
    assert [line.split()[0] for line in scored.stdout.splitlines()[:3]] == ["task", "mc", "code"]
    report = json.loads((checkpoint / "eval.json").read_text())
    assert report["tasks"] == ["mc", "code"]
    # The same weights, windows and batches in one process: the same numbers.
    for key in ("eval/mc/acc", "eval/mc/acc_norm", "eval/code/bpb"):
        assert report["metrics"][key] == last[key]
    wrong = kempnerforge("eval", config, f"--checkpoint={checkpoint}", "--tasks", "nope")
    assert wrong.returncode == 2
    assert "--tasks = ['nope']: expected names of eval.tasks: mc, code" in wrong.stderr
    assert "Traceback" not in wrong.stderr
