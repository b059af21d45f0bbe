"""End to end: README.md's "Using it" commands, run as written and in order, do what their
comments say, after `make train` has left a finished runs/debug behind."""

from __future__ import annotations

import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from tests.support.cli import run_kempnerforge
from tests.support.metrics_rows import events, train_rows
from tests.support.threads import PROCESS_THREADS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

REPO = pathlib.Path(__file__).parents[2]
COMMAND = ".venv/bin/kempnerforge"


def readme_commands() -> list[str]:
    """The shell lines of the first sh block under '## Using it', comments left out."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Using it", 1)[1]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def run(
    line: str, cwd: pathlib.Path, env: dict[str, str], *, script: bool = False
) -> subprocess.CompletedProcess:
    """The README line in a process of its own: through the venv's console script when
    ``script``, else as `python -m kempnerforge` (the script's own entry point, cli.main)
    forked from the warm server."""
    argv = shlex.split(line)
    assert argv[0] == COMMAND, f"README command does not start with {COMMAND}: {line}"
    if script:
        argv[0] = str(pathlib.Path(sys.executable).parent / "kempnerforge")
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    return run_kempnerforge(*argv[1:], cwd=cwd, env_extra=env, timeout=1200)


def train_steps(run_dir: pathlib.Path) -> list[int]:
    """Steps of the logged training rows (the debug config logs every 10th step)."""
    return [r["step"] for r in train_rows(run_dir)]


def event_steps(run_dir: pathlib.Path, name: str) -> list[int]:
    return [r["step"] for r in events(run_dir, name)]


def latest(run_dir: pathlib.Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def test_the_readme_commands_do_what_their_comments_say(tmp_path, builtin_cache):
    # A checkout's inputs, linked into a fresh working directory so runs/ and data/ land
    # in tmp_path and not in the repository.
    for name in ("configs", "kempnerforge", "docs"):
        (tmp_path / name).symlink_to(REPO / name)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": PROCESS_THREADS,
        "KEMPNERFORGE_CACHE": str(builtin_cache),
    }
    common = " --metrics.progress=off --train.sample_tokens=8"
    # What `make train` leaves: a finished runs/debug (shortened here to 2 steps).
    made = run(
        f"{COMMAND} train configs/train/debug.toml --train.max_steps=2{common}",
        tmp_path,
        env,
        script=True,
    )
    assert made.returncode == 0, made.stderr[-3000:]
    debug_metrics = (tmp_path / "runs" / "debug" / "metrics.jsonl").read_text()

    commands = readme_commands()
    assert len(commands) == 9, commands
    results = []
    for line in commands:
        result = run(line, tmp_path, env)
        assert result.returncode == 0, f"{line}\n{result.stderr[-3000:]}"
        results.append(result)

    quick = tmp_path / "runs" / "quick"
    # 20 steps, then the same run resumed at 21 (its first step is always logged) to 30.
    assert train_steps(quick) == [1, 10, 20, 21, 30]
    assert event_steps(quick, "resume") == [20]
    assert latest(quick) == "step_30"
    assert "resumed from" in results[1].stderr
    for prepared in ("data/mycorpus", "data/mycorpus-eval"):
        assert (tmp_path / prepared / "meta.json").is_file(), prepared
    mycorpus = tmp_path / "runs" / "mycorpus"
    assert train_steps(mycorpus) == [1, 10, 20, 30]
    assert event_steps(mycorpus, "resume") == []
    assert latest(mycorpus) == "step_30"
    report = json.loads((mycorpus / "checkpoints" / "step_30" / "eval.json").read_text())
    assert report["step"] == 30 and report["metrics"]["eval_tokens"] > 0
    assert "eval_loss" in report["metrics"]
    assert results[5].stdout.startswith("def ") and len(results[5].stdout) > len("def ")
    exported = tmp_path / "exported" / "mycorpus"
    assert {"config.json", "model.safetensors"} <= {p.name for p in exported.iterdir()}
    plots = sorted(p.name for p in (quick / "plots").iterdir())
    assert {"loss.png", "lr.png", "tokens_per_sec.png", "grad_norm.png"} <= set(plots)
    assert "goodput.png" in plots
    # Two start-ups and the gap between the two launches of runs/quick, each shown.
    table = {line.split()[0]: line.split() for line in results[8].stdout.splitlines()[2:-2]}
    assert float(table["startup"][1]) > 0 and float(table["restart_gap"][1]) > 0
    assert "goodput: " in results[8].stdout
    # None of them touched the run `make train` made.
    assert (tmp_path / "runs" / "debug" / "metrics.jsonl").read_text() == debug_metrics
