"""scripts/slurm/ft_groups.sbatch through a real SLURM (a one-node cluster of this
machine): two replica groups share the node, one group's job step is cancelled mid-run,
the script relaunches it, it rejoins from its peer and the job completes with the losses
of an uninterrupted job.

What SLURM does here (22.05), which the test relies on: `scancel JOBID.STEPID` kills the
step's processes with SIGKILL at once (no SIGTERM first: a trap in the step never runs),
and its `srun` returns 137 (128 + 9), which the script treats as a dead group to
relaunch; the relaunched group is a new step of the same job (the next step id, the same
name), and the batch script's exit code (0) makes the job COMPLETED.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest

from kempnerforge.config.loader import load_config
from tests.support.metrics_rows import read_rows, train_rows
from tests.support.replica_groups import HOLD_START_ENV, PAUSE_ENV, SLOW_WHILE_ENV
from tests.support.slurm_cluster import SlurmCluster
from tests.support.tiny import tiny_run
from tests.support.tolerance import layout_atol

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
SCRIPT = str(REPO / "scripts" / "slurm" / "ft_groups.sbatch")
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
JOB_TIMEOUT_S = 300.0
MAX_STEPS = 60
SEQ_LEN, TOKENS = 32, 2 * 4 * 32
"""A window's length, and a step's global batch in tokens (2 slots of 4 sequences)."""
TINY = ("--model.n_kv_heads=2", "--train.deterministic=true", "--train.sample_tokens=0")
END = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}


def _submit(slurm: SlurmCluster, log_dir: pathlib.Path, overrides: list[str], **env: str) -> int:
    """ft_groups.sbatch with two groups on the one node, this interpreter's venv and imports
    (the SlowSteps hook is the tests' own)."""
    job_env = {
        "VENV": str(pathlib.Path(sys.executable).parents[1]),
        "PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO)),
        "NUM_GROUPS": "2",
        "RELAUNCH_DELAY_S": "1",
        "OMP_NUM_THREADS": "1",
        **env,
    }
    return slurm.sbatch(
        "--nodes=1", f"--output={log_dir}/job-%j.out", SCRIPT, DEBUG, *overrides,
        cwd=REPO, env_extra=job_env,
    )  # fmt: skip


def _overrides(run_dir: pathlib.Path, token_dirs: tuple[str, str]) -> list[str]:
    return tiny_run(
        run_dir,
        token_dirs,
        *TINY,
        f"--train.max_steps={MAX_STEPS}",
        "--eval.interval=0",
        "--fault_tolerance.num_replica_groups=2",
        "--train.hooks=['tests.support.replica_groups:SlowSteps']",
    )


def _participants(run_dir: pathlib.Path, *, live: bool = False) -> dict[int, int]:
    """Each committed data step's number of groups, from the group's replica_step events."""
    return {
        r["data_step"]: r["participants"]
        for r in read_rows(run_dir, live=live)
        if r.get("event") == "replica_step"
    }


def _wait(condition, what: str, slurm: SlurmCluster, job: int, log: pathlib.Path) -> None:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not condition():
        state = slurm.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING"), f"job {state} before {what}:\n{_tail(log)}"
        assert time.monotonic() < deadline, f"no {what} in {JOB_TIMEOUT_S} s:\n{_tail(log)}"
        time.sleep(0.2)


def _tail(log: pathlib.Path) -> str:
    return log.read_text()[-4000:] if log.exists() else "(no log)"


def test_a_cancelled_group_step_is_relaunched_and_rejoins(slurm, token_dirs, tmp_path):
    whole_dir, faulted_dir = tmp_path / "whole", tmp_path / "faulted"
    slow, hold = tmp_path / "slow_steps", tmp_path / "hold_start"
    slow.touch()
    whole = _submit(slurm, tmp_path, _overrides(whole_dir, token_dirs), **{PAUSE_ENV: "0"})
    job = _submit(
        slurm, tmp_path, _overrides(faulted_dir, token_dirs),
        **{PAUSE_ENV: "0.5", SLOW_WHILE_ENV: str(slow), HOLD_START_ENV: str(hold)},
    )  # fmt: skip
    try:
        _cancel_group_1_midway(slurm, job, tmp_path / f"job-{job}.out", faulted_dir, slow, hold)
        done = slurm.wait_for(job, END, JOB_TIMEOUT_S)
        reference = slurm.wait_for(whole, END, JOB_TIMEOUT_S)
    finally:
        slurm.run("scancel", str(job), str(whole))  # nothing left running if it failed
    assert done["JobState"] == "COMPLETED" and done["ExitCode"] == "0:0", _tail(
        tmp_path / f"job-{job}.out"
    )
    assert reference["JobState"] == "COMPLETED", _tail(tmp_path / f"job-{whole}.out")
    _assert_losses_match(faulted_dir, whole_dir)


def _cancel_group_1_midway(
    slurm: SlurmCluster,
    job: int,
    log: pathlib.Path,
    run_dir: pathlib.Path,
    slow: pathlib.Path,
    hold: pathlib.Path,
) -> None:
    """At group 1's third step, scancel its job step; wait for the script to relaunch it
    (a new step of the job, the same name), held at its start until group 0 has committed
    a step alone (else a fast relaunch could rejoin before group 0's next quorum, and
    nothing here would show that group 0 trained on without it); let it rejoin, then let
    the groups finish at full speed."""
    _wait(lambda: len(train_rows(run_dir / "replica_1", live=True)) >= 3, "step 3", slurm, job, log)
    first = slurm.steps(job)
    assert set(first) == {"group0", "group1"}, first  # both groups share the one node
    hold.touch()
    assert slurm.run("scancel", first["group1"]).returncode == 0
    relaunch = "group 1: exit 137: relaunching"
    _wait(lambda: relaunch in log.read_text(), "relaunch", slurm, job, log)
    _wait(lambda: 1 in _participants(run_dir / "replica_0", live=True).values(),
          "a step of group 0 alone", slurm, job, log)  # fmt: skip
    hold.unlink()
    rejoined = "replica group 1 joined at step"  # "... with a peer's live state"
    _wait(lambda: rejoined in log.read_text().split(relaunch)[1], "rejoin", slurm, job, log)
    relaunched = slurm.steps(job).get("group1", "")
    assert relaunched.split(".")[0] == str(job) and relaunched != first["group1"], relaunched
    slow.unlink()


def _assert_losses_match(run: pathlib.Path, whole: pathlib.Path) -> None:
    """Every step's loss equals the uninterrupted job's: bitwise while every data step so
    far had the same groups in both jobs (the same sums in the same order), then to the
    rounding of summing the step's slots in one process instead of over two (layout_atol,
    as tests/distributed/test_replica_groups.py)."""
    # Either group of a job may have started late and joined with the other's state, and
    # group 1 of this one was down a while: both log the same global loss, so the union of
    # their rows is every step.
    losses = {r["step"]: r["loss"] for g in (0, 1) for r in train_rows(run / f"replica_{g}")}
    reference = {r["step"]: r["loss"] for g in (0, 1) for r in train_rows(whole / f"replica_{g}")}
    assert sorted(losses) == sorted(reference) == list(range(1, MAX_STEPS + 1))
    ours = {**_participants(run / "replica_1"), **_participants(run / "replica_0")}
    theirs = {**_participants(whole / "replica_0"), **_participants(whole / "replica_1")}
    assert 1 in ours.values(), ours  # group 0 stepped alone while group 1 was down
    model = load_config(DEBUG, tiny_run(None, None, *TINY)).model
    same_so_far = True
    for step in range(1, MAX_STEPS + 1):
        same_so_far = same_so_far and ours[step - 1] == theirs[step - 1]
        if same_so_far:
            assert losses[step] == reference[step], step
        atol = layout_atol(
            model, SEQ_LEN, tokens=TOKENS, updates=step - 1, magnitude=reference[step]
        )
        assert losses[step] == pytest.approx(reference[step], abs=atol), step
