"""End to end: a stop signal saves the last step and exits 75; the run then resumes there.

The plain SIGTERM case lives in test_train_cli.py; these cover the other signals, a
second SIGTERM right after the first, and resuming the interrupted run directory.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.resilience import exit_codes

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
COMMON = [
    "--metrics.progress=off",
    "--metrics.log_interval=1",
    "--checkpoint.interval=0",
    "--train.sample_prompt=",
    "--scheduler.warmup_steps=2",  # the resume's max_steps is only a few steps past the stop
]
WAIT_S = 120.0


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> pathlib.Path:
    """One KEMPNERFORGE_CACHE for the module: the built-in corpus is prepared once."""
    return tmp_path_factory.mktemp("cache")


@dataclass
class Run:
    """A `kempnerforge train` subprocess whose output goes to files (no pipe can fill up)."""

    proc: subprocess.Popen
    run_dir: pathlib.Path
    stdout: pathlib.Path
    stderr: pathlib.Path

    def err(self) -> str:
        return self.stderr.read_text()

    def finish(self) -> int:
        """Wait for the exit (killing the run after WAIT_S) and return its code."""
        try:
            return self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"the run did not exit within {WAIT_S:.0f} s:\n{self.err()[-3000:]}")


def start(run_dir: pathlib.Path, cache: pathlib.Path, *overrides: str) -> Run:
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir.parent
    stdout, stderr = logs / f"{run_dir.name}.out", logs / f"{run_dir.name}.err"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KEMPNERFORGE_CACHE": str(cache)}
    with open(stdout, "a") as out, open(stderr, "a") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kempnerforge", "train", DEBUG, *COMMON]
            + [f"--train.run_dir={run_dir}", *overrides],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=err,
        )
    return Run(proc, run_dir, stdout, stderr)


def logged_steps(run_dir: pathlib.Path) -> list[int]:
    """Steps of the training rows in metrics.jsonl so far (a half-written last row is skipped)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    steps = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if "event" not in row and "loss" in row:
            steps.append(row["step"])
    return steps


def wait_until(run: Run, ready: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ready():
        if run.proc.poll() is not None:
            pytest.fail(
                f"the run exited ({run.proc.returncode}) before {what}:\n{run.err()[-3000:]}"
            )
        if time.monotonic() > deadline:
            run.proc.kill()
            pytest.fail(f"no {what} within {WAIT_S:.0f} s:\n{run.err()[-3000:]}")
        time.sleep(0.1)


@dataclass
class Stopped:
    """What a signalled run left behind."""

    run_dir: pathlib.Path
    returncode: int
    stderr: str
    last_logged: int
    latest: str
    complete: bool


def train_then_signal(
    run_dir: pathlib.Path, cache: pathlib.Path, sig: signal.Signals, *, twice: bool = False
) -> Stopped:
    run = start(run_dir, cache, "--train.max_steps=10000")
    wait_until(run, lambda: len(logged_steps(run_dir)) >= 2, "2 logged steps")
    run.proc.send_signal(sig)
    if twice:
        # Right after the first, as when slurmd and the batch script's trap both send one.
        run.proc.send_signal(sig)
    returncode = run.finish()
    checkpoints = run_dir / "checkpoints"
    pointer = checkpoints / "latest"
    latest = pointer.read_text().strip() if pointer.exists() else ""
    manager = CheckpointManager(CheckpointConfig(), str(checkpoints))
    return Stopped(
        run_dir=run_dir,
        returncode=returncode,
        stderr=run.err(),
        last_logged=logged_steps(run_dir)[-1],
        latest=latest,
        complete=bool(latest) and manager.is_complete(checkpoints / latest),
    )


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGINT], ids=["SIGUSR1", "SIGINT"])
def test_a_stop_signal_saves_the_last_logged_step_and_exits_preempted(sig, tmp_path, cache):
    stopped = train_then_signal(tmp_path / "run", cache, sig)
    assert stopped.returncode == exit_codes.PREEMPTED, stopped.stderr[-3000:]
    assert stopped.latest == f"step_{stopped.last_logged}"
    assert stopped.last_logged >= 2
    assert stopped.complete
    assert f"shutdown requested by {sig.name}" in stopped.stderr
    assert "Traceback" not in stopped.stderr


@pytest.fixture(scope="module")
def double_sigterm(tmp_path_factory, cache) -> Stopped:
    """A run stopped by two SIGTERMs in a row (resumed by a later test)."""
    return train_then_signal(
        tmp_path_factory.mktemp("double") / "run", cache, signal.SIGTERM, twice=True
    )


def test_a_second_sigterm_right_after_the_first_still_exits_preempted(double_sigterm):
    stopped = double_sigterm
    assert stopped.returncode == exit_codes.PREEMPTED, stopped.stderr[-3000:]
    assert stopped.latest == f"step_{stopped.last_logged}"
    assert stopped.complete
    assert "Traceback" not in stopped.stderr


def test_resuming_a_stopped_run_trains_only_the_remaining_steps(double_sigterm, cache):
    stopped = double_sigterm
    assert stopped.returncode == exit_codes.PREEMPTED, stopped.stderr[-3000:]
    n = stopped.last_logged
    before = logged_steps(stopped.run_dir)
    run = start(stopped.run_dir, cache, f"--train.max_steps={n + 3}")
    assert run.finish() == exit_codes.FINISHED, run.err()[-3000:]
    assert logged_steps(stopped.run_dir)[len(before) :] == [n + 1, n + 2, n + 3]
    assert (stopped.run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{n + 3}"
    assert f"finished at step {n + 3}" in run.stdout.read_text()
