"""scripts/slurm/train.sbatch through a real SLURM (a one-node cluster of this machine):
submitted as it is to a partition without GPUs, and preempted by SLURM's own signal."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest

from tests.support.metrics_rows import read_rows
from tests.support.slurm_cluster import SlurmCluster
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
SCRIPT = str(REPO / "scripts" / "slurm" / "train.sbatch")
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
JOB_TIMEOUT_S = 240.0


def _job_env() -> dict[str, str]:
    """The environment a job starts with: this interpreter's venv, its imports, one thread
    per rank's process group being what the script's torchrun gives."""
    env = {"VENV": str(pathlib.Path(sys.executable).parents[1])}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return env


def _submit(slurm: SlurmCluster, log_dir: pathlib.Path, *overrides: str) -> int:
    return slurm.sbatch(
        f"--output={log_dir}/job-%j.out",
        SCRIPT,
        DEBUG,
        *overrides,
        cwd=REPO,
        env_extra=_job_env(),
    )


def _log(log_dir: pathlib.Path, job_id: int) -> str:
    return (log_dir / f"job-{job_id}.out").read_text()


def _tiny(run_dir: pathlib.Path, token_dirs: tuple[str, str], *extra: str) -> list[str]:
    return tiny_run(run_dir, token_dirs, "--model.n_kv_heads=2", *extra)


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r and "event" not in r}


def test_the_script_runs_on_a_partition_without_gpus_as_it_is(slurm, token_dirs, tmp_path):
    """No edit and no option: the script asks for no GPUs, so a CPU partition takes it, and
    the node runs one rank."""
    run_dir = tmp_path / "run"
    job = _submit(slurm, tmp_path, *_tiny(run_dir, token_dirs, "--train.max_steps=4"))
    record = slurm.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    log = _log(tmp_path, job)
    assert record["JobState"] == "COMPLETED" and record["ExitCode"] == "0:0", log
    assert "(1 nodes x 1 ranks)" in log and log.rstrip().endswith("training finished")
    assert sorted(_losses(run_dir)) == [1, 2, 3, 4]


def test_a_preempted_job_saves_is_requeued_and_resumes_exactly(slurm, token_dirs, tmp_path):
    """SLURM's USR1 to the batch shell: the run saves and exits 75, the script requeues the
    job, SLURM holds it (BeginTime; released here instead of waited for), and the restart
    resumes to the end with every step's loss equal to an uninterrupted run's. The log
    says so in one line each, with no traceback."""
    steps = ["--train.max_steps=300"]
    whole_dir, preempted_dir = tmp_path / "whole", tmp_path / "preempted"
    whole = _submit(slurm, tmp_path, *_tiny(whole_dir, token_dirs, *steps))
    slurm.wait_for(whole, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    job = _submit(slurm, tmp_path, *_tiny(preempted_dir, token_dirs, *steps))
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (preempted_dir / "metrics.jsonl").exists() or len(_losses(preempted_dir)) < 3:
        running = slurm.job(job).get("JobState") in ("PENDING", "RUNNING")
        assert running and time.monotonic() < deadline, _log(tmp_path, job)
        time.sleep(0.2)
    assert slurm.run("scancel", "--batch", "--signal=USR1", str(job)).returncode == 0
    held = slurm.wait_for(job, {"PENDING", "COMPLETED", "FAILED"}, JOB_TIMEOUT_S)
    log = _log(tmp_path, job)
    assert held["JobState"] == "PENDING", log
    assert held["Reason"] == "BeginTime" and held["Restarts"] == "1", held
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    done = slurm.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    log = _log(tmp_path, job)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", log
    assert "saved after a stop signal: requeueing job" in log
    assert log.count("torchrun: stopped by SIGUSR1") == 1
    assert "Traceback" not in log and "death signal" not in log
    assert f"job {job} restart 1 on" in log
    assert _losses(preempted_dir) == _losses(whole_dir)
