"""End to end under torchrun, two CPU ranks: a stop signal to the whole process group, a
peer killed outright and a peer that hangs."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import sys
import time

import pytest

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.resilience import exit_codes
from tests.e2e.test_signals import (
    COMMON,
    DEBUG,
    REPO,
    Run,
    live_processes_in_group,
    logged_losses,
    logged_steps,
    wait_until,
)
from tests.support.cli import run_kempnerforge
from tests.support.exit_marks import ATEXIT_DIR_ENV
from tests.support.metrics_rows import events

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 30
LAYOUT = [
    "--distributed.dp_shard=2",
    "--train.deterministic=true",
    "--train.batch_size=1",
    "--train.seq_len=64",
    f"--train.max_steps={STEPS}",
]
TIMEOUT_S = 8


def start_torchrun(run_dir: pathlib.Path, cache: pathlib.Path, *overrides: str) -> Run:
    """`torchrun --nproc_per_node=2 -m kempnerforge train`, leading its own process group
    (as srun's task does), with rank 0's exit code written to ``run_dir``.exit."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "KEMPNERFORGE_CACHE": str(cache),
        "KEMPNERFORGE_EXIT_CODE_FILE": str(run_dir.parent / f"{run_dir.name}.exit"),
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", "-m", "kempnerforge", "train", DEBUG, *COMMON]
    command += [f"--train.run_dir={run_dir}", *overrides]
    return Run.launch(command, run_dir, env, own_group=True)


def rank_code(run: Run) -> int:
    return int((run.run_dir.parent / f"{run.run_dir.name}.exit").read_text())


def worker_pid(run: Run, rank: int) -> int:
    """The pid of training rank ``rank`` among the torchrun agent's children."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for environ in pathlib.Path("/proc").glob("[0-9]*/environ"):
            try:
                env = environ.read_bytes().split(b"\0")
                stat = (environ.parent / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            if parent == run.proc.pid and f"RANK={rank}".encode() in env:
                return int(environ.parent.name)
        time.sleep(0.2)
    pytest.fail(f"no rank {rank} process under torchrun {run.proc.pid}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, builtin_cache) -> list[tuple[int, float]]:
    """An uninterrupted run; its end-of-run sample needs both ranks (FSDP gathers)."""
    run_dir = tmp_path_factory.mktemp("torchrun-reference") / "run"
    sample = ["--train.sample_prompt=def ", "--train.sample_tokens=8"]
    run = start_torchrun(run_dir, builtin_cache, *LAYOUT, *sample)
    assert run.finish() == 0, run.err()[-3000:]
    assert rank_code(run) == exit_codes.FINISHED
    assert run.stdout.read_text().count("sample (greedy, 8 tokens)") == 1
    return logged_losses(run_dir)


def test_a_layout_that_does_not_fit_stops_every_rank_with_one_line(tmp_path, builtin_cache):
    run = start_torchrun(tmp_path / "run", builtin_cache, "--distributed.tp=3")
    returncode = run.finish()
    stderr = run.err()
    assert returncode != 0
    assert rank_code(run) == exit_codes.CONFIG_ERROR
    errors = [x for x in stderr.splitlines() if x.startswith("kempnerforge: error:")]
    assert len(errors) == 2 and errors[0] == errors[1], stderr[-3000:]
    assert "distributed.dp_shard = -1: expected dp_replicate * dp_shard * cp * tp * pp" in errors[0]
    # No rank printed a traceback (torchrun prints its own, about the ranks' exit codes,
    # through the runner that ran its module when it was forked from the warm server).
    runner = f'File "{REPO / "kempnerforge" / "launch" / "forked_command.py"}'
    frames = [x for x in stderr.splitlines() if f'File "{REPO / "kempnerforge"}' in x]
    assert all(x.strip().startswith(runner) for x in frames), stderr[-3000:]


def test_sigterm_to_the_torchrun_group_saves_once_on_every_rank_and_resumes_bitwise(
    tmp_path, builtin_cache, reference
):
    run_dir = tmp_path / "run"
    run = start_torchrun(run_dir, builtin_cache, *LAYOUT)
    wait_until(run, lambda: len(logged_steps(run_dir)) >= 2, "2 logged steps")
    # What slurmd sends on scancel or preemption: the agent and both ranks get it.
    os.killpg(run.proc.pid, signal.SIGTERM)
    run.finish()
    stderr = run.err()
    assert rank_code(run) == exit_codes.PREEMPTED, stderr[-3000:]
    assert live_processes_in_group(run.proc.pid) == []
    stopped_at = logged_steps(run_dir)[-1]
    assert 2 <= stopped_at < STEPS
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_")) == [
        f"step_{stopped_at}"
    ]
    assert CheckpointManager(CheckpointConfig(), str(checkpoints)).is_complete(
        checkpoints / f"step_{stopped_at}"
    )
    assert len(events(run_dir, "checkpoint")) == 1

    resumed = start_torchrun(run_dir, builtin_cache, *LAYOUT)
    assert resumed.finish() == 0, resumed.err()[-3000:]
    assert logged_losses(run_dir) == reference


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_lost_peer_ends_the_run_within_the_timeout_naming_it(tmp_path, builtin_cache, how):
    run_dir = tmp_path / "run"
    run = start_torchrun(
        run_dir,
        builtin_cache,
        *LAYOUT,
        "--train.max_steps=100000",
        f"--distributed.timeout_s={TIMEOUT_S}",
    )
    wait_until(run, lambda: len(logged_steps(run_dir)) >= 2, "2 logged steps")
    peer = worker_pid(run, 1)
    started = time.monotonic()
    os.kill(peer, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    try:
        wait_until(run, lambda: "kempnerforge: error: rank 0" in run.err(), "rank 0's error")
        elapsed = time.monotonic() - started
    finally:
        if how == "hung":
            # What the scheduler does to a job step that is over: torchrun's SIGTERM cannot
            # reach a stopped process, so it would wait 30 s before its own SIGKILL.
            with contextlib.suppress(ProcessLookupError):
                os.kill(peer, signal.SIGKILL)
    returncode = run.finish()
    stderr = run.err()
    assert returncode != 0
    assert rank_code(run) == exit_codes.FAILED, stderr[-3000:]
    line = next(x for x in stderr.splitlines() if x.startswith("kempnerforge: error: rank 0"))
    assert "failed" in line and f"distributed.timeout_s = {TIMEOUT_S}" in line
    if how == "hung":
        # Noticed when the timeout ran out; the barrier that names the peer waits as long.
        assert "rank(s) 1 did not respond" in line
        assert TIMEOUT_S <= elapsed < 2 * TIMEOUT_S + 20, stderr[-3000:]
    else:
        assert "rank(s) 1 did not respond" in line or "exited" in line
        assert elapsed < TIMEOUT_S + 20, stderr[-3000:]


def test_ranks_end_without_finalisation_once_they_left_their_process_group(
    tmp_path, builtin_cache, monkeypatch
):
    """A rank that left its process group ends at once (cli.main): no gloo thread can then
    abort it during the interpreter's finalisation, after its work is done (exit 134 in
    place of its code). Its output, metrics and exit code are complete; an atexit handler
    does not run. One process, which joined no group, finalises as usual."""
    monkeypatch.setenv(ATEXIT_DIR_ENV, str(tmp_path))
    hook = "--train.hooks=['tests.support.exit_marks:MarkAtExit']"
    run = start_torchrun(tmp_path / "run", builtin_cache, *LAYOUT, "--train.max_steps=3", hook)
    assert run.finish() == 0, run.err()[-3000:]
    assert rank_code(run) == exit_codes.FINISHED
    assert "finished at step 3" in run.stdout.read_text()
    assert logged_steps(tmp_path / "run") == [1, 2, 3]
    assert not list(tmp_path.glob("atexit-*"))

    one_step = ["--train.max_steps=1", f"--train.run_dir={tmp_path / 'one'}"]
    one = run_kempnerforge(
        "train",
        DEBUG,
        *COMMON,
        *one_step,
        "--train.batch_size=1",
        hook,
        env_extra={"KEMPNERFORGE_CACHE": str(builtin_cache)},
    )
    assert one.returncode == 0, one.stderr[-3000:]
    assert (tmp_path / "atexit-rank0").read_text() == "finalised\n"
