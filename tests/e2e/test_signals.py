"""End to end: a stop signal saves the last step and exits 75; the run then resumes there.

The plain SIGTERM case lives in test_train_cli.py; these cover the other signals, a
second SIGTERM right after the first, resuming the interrupted run directory, and a signal
sent to the whole process group (as slurmd and Ctrl-C send it) with and without dataloader
workers, resumed bitwise.
"""

from __future__ import annotations

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
from tests.support.metrics_rows import train_rows
from tests.support.warm_process import WarmProcess, popen

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
# Deterministic runs for the bitwise comparison: the stopped run, its resume and the
# uninterrupted reference all train to this step, so their LR schedules are the same.
# Small batches keep each of these runs to a couple of seconds of training, while a step
# still takes long enough (tens of ms) for the signal to land well before the last one.
EXACT_STEPS = 40
EXACT = [
    "--train.deterministic=true",
    f"--train.max_steps={EXACT_STEPS}",
    "--train.batch_size=2",
    "--train.seq_len=64",
]


@pytest.fixture(scope="module")
def cache(builtin_cache) -> pathlib.Path:
    """The session's KEMPNERFORGE_CACHE: the built-in corpus is prepared once."""
    return builtin_cache


@dataclass
class Run:
    """A `kempnerforge train` subprocess whose output goes to files (no pipe can fill up)."""

    proc: WarmProcess | subprocess.Popen
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

    @classmethod
    def launch(
        cls, command: list[str], run_dir: pathlib.Path, env: dict[str, str], own_group: bool
    ) -> Run:
        """Start ``command`` in the repository, its output appended to ``run_dir``.out and
        .err beside ``run_dir`` (so a relaunch into the same run directory keeps both)."""
        run_dir.mkdir(parents=True, exist_ok=True)
        logs = run_dir.parent
        stdout, stderr = logs / f"{run_dir.name}.out", logs / f"{run_dir.name}.err"
        with open(stdout, "a") as out, open(stderr, "a") as err:
            proc = popen(
                command, cwd=REPO, env=env, stdout=out, stderr=err, start_new_session=own_group
            )
        return cls(proc, run_dir, stdout, stderr)


def start(
    run_dir: pathlib.Path, cache: pathlib.Path, *overrides: str, own_group: bool = False
) -> Run:
    """Start a run; with ``own_group`` it leads a process group of its own (its pid is the
    group id), so a signal to the group reaches it and its dataloader workers only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KEMPNERFORGE_CACHE": str(cache)}
    command = [sys.executable, "-m", "kempnerforge", "train", DEBUG, *COMMON]
    return Run.launch([*command, f"--train.run_dir={run_dir}", *overrides], run_dir, env, own_group)


def logged_losses(run_dir: pathlib.Path) -> list[tuple[int, float]]:
    """(step, loss) of the training rows in metrics.jsonl so far (a half-written last row is
    skipped)."""
    return [(row["step"], row["loss"]) for row in train_rows(run_dir, live=True)]


def logged_steps(run_dir: pathlib.Path) -> list[int]:
    """Steps of the training rows in metrics.jsonl so far."""
    return [step for step, _ in logged_losses(run_dir)]


def live_processes_in_group(pgid: int) -> list[str]:
    """Command lines of the processes of group ``pgid`` still running (zombies excluded)."""
    live = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        try:
            # The fields after the parenthesised name: state, ppid, pgrp, ...
            state, _ppid, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue  # exited while being read
        if int(pgrp) == pgid and state != "Z":
            live.append(f"{stat.parent.name}: {cmdline}")
    return live


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


@pytest.fixture(scope="module")
def reference_losses(tmp_path_factory, cache) -> list[tuple[int, float]]:
    """(step, loss) of an uninterrupted deterministic run to EXACT_STEPS."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    run = start(run_dir, cache, *EXACT)
    assert run.finish() == exit_codes.FINISHED, run.err()[-3000:]
    losses = logged_losses(run_dir)
    assert [step for step, _ in losses] == list(range(1, EXACT_STEPS + 1))
    return losses


@pytest.mark.parametrize("num_workers", [0, 2], ids=["no-workers", "2-workers"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_saves_and_resumes_bitwise(
    sig, num_workers, tmp_path, cache, reference_losses
):
    run_dir = tmp_path / "run"
    workers = f"--data.num_workers={num_workers}"
    run = start(run_dir, cache, *EXACT, workers, own_group=True)
    wait_until(run, lambda: len(logged_steps(run_dir)) >= 2, "2 logged steps")
    # What slurmd does to a job step and a terminal does on Ctrl-C: every process of the
    # group gets the signal, the dataloader workers too.
    os.killpg(run.proc.pid, sig)
    returncode = run.finish()
    stderr = run.err()
    assert returncode == exit_codes.PREEMPTED, stderr[-3000:]
    assert "Traceback" not in stderr
    assert f"shutdown requested by {sig.name}" in stderr
    assert live_processes_in_group(run.proc.pid) == []
    stopped_at = logged_steps(run_dir)[-1]
    assert 2 <= stopped_at < EXACT_STEPS
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == f"step_{stopped_at}"
    manager = CheckpointManager(CheckpointConfig(), str(checkpoints))
    assert manager.is_complete(checkpoints / f"step_{stopped_at}")

    resumed = start(run_dir, cache, *EXACT, workers)
    assert resumed.finish() == exit_codes.FINISHED, resumed.err()[-3000:]
    # The stopped run and its resume log exactly the uninterrupted run's losses, step by step.
    assert logged_losses(run_dir) == reference_losses
