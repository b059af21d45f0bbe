"""scripts/slurm/train.sbatch through a real SLURM (a one-node cluster of this machine):
submitted as it is to a partition without GPUs, preempted by SLURM's own signal, stopped by
its time limit, and ended by each fault whose exit code the script acts on.

The fault jobs are submitted together at the module's first use (fault_jobs) and run side
by side on the node's cores while the tests read them one by one: the module costs about
its longest job, not the sum."""

from __future__ import annotations

import os
import pathlib
import sys
import time

import pytest

from kempnerforge.resilience import exit_codes
from tests.support.faults import NAN_AT_ENV, SLEEP_AT_ENV, SLEEP_RANK_ENV
from tests.support.metrics_rows import events, read_rows
from tests.support.slurm_cluster import DRAINED_NODE, SlurmCluster
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


def _submit(
    slurm: SlurmCluster,
    log_dir: pathlib.Path,
    *overrides: str,
    options: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> int:
    """sbatch train.sbatch DEBUG OVERRIDES, with sbatch ``options`` before the script (they
    override its #SBATCH lines) and ``env`` added to the job's environment."""
    return slurm.sbatch(
        f"--output={log_dir}/job-%j.out",
        *options,
        SCRIPT,
        DEBUG,
        *overrides,
        cwd=REPO,
        env_extra={**_job_env(), **(env or {})},
    )


def _log(log_dir: pathlib.Path, job_id: int) -> str:
    return (log_dir / f"job-{job_id}.out").read_text()


def _tiny(run_dir: pathlib.Path, token_dirs: tuple[str, str], *extra: str) -> list[str]:
    return tiny_run(run_dir, token_dirs, "--model.n_kv_heads=2", *extra)


def _losses(run_dir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_rows(run_dir) if "loss" in r and "event" not in r}


def _release(slurm: SlurmCluster, job: int) -> None:
    """End the hold SLURM puts on a requeued job (about two minutes here) now.

    Not in the second its last run was killed: slurmd refuses a launch whose credential is
    not newer, in whole seconds, than that kill ("Job N already killed, do not launch batch
    job"), and the job then FAILS. SLURM's own hold never meets this; a release at once did.
    The jobs are submitted together, so on a loaded machine SLURM's own hold may have ended
    before a test gets here: a job no longer pending has been released already.
    """
    time.sleep(2.0)
    released = slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    assert released.returncode == 0 or "no longer pending" in released.stderr, released


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}
TIME_LIMIT = ("--time=1", "--signal=B:USR1@5")
"""SLURM's shortest limit, a minute (it counts in minutes), and its warning 5 s before it.
SLURM checks limits every 30 s and sends the warning at the first check that finds less
than the warning's time plus 30 s left: here 25 to 55 s into the job, after the run has
started, and at least 30 s before SLURM's kill. (With @30 it came at the job's first check,
at any time from 0 s, before the run had started at all.)"""


@pytest.fixture(scope="module")
def fault_jobs(slurm, token_dirs, tmp_path_factory) -> dict[str, tuple[int, pathlib.Path]]:
    """Each fault the script acts on, as a job of its own: (job id, its directory), the run
    in <directory>/run and the log in <directory>/job-<id>.out. Submitted at once."""
    names = ("limit", "nan", "fault", "hang", "killed")
    where = {name: tmp_path_factory.mktemp(name) for name in names}
    (where["killed"] / "armed").write_text("")

    def submit(name: str, hook: str, env: dict[str, str], *extra: str) -> tuple[int, pathlib.Path]:
        hooks = [f"--train.hooks=['tests.support.faults:{hook}']"] if hook else []
        overrides = _tiny(where[name] / "run", token_dirs, *hooks, *extra)
        options = TIME_LIMIT if name == "limit" else ()
        return _submit(slurm, where[name], *overrides, options=options, env=env), where[name]

    submitted = {
        # Runs until stopped (pausing after each step, not to spend the wait training): the
        # time limit's warning stops it, twice, and MAX_RESTARTS=1 lets the script requeue
        # the first stop only.
        "limit": submit(
            "limit", "PauseAfterEachStep", {"MAX_RESTARTS": "1"}, "--train.max_steps=1000000"
        ),
        "nan": submit(
            "nan",
            "NaNWeightsAt",
            {NAN_AT_ENV: "3"},
            "--train.max_steps=50",
            "--train.attribute_faults=false",
            "--train.nan_consecutive_max=2",
            "--train.nan_max_rollbacks=0",
        ),
        "fault": submit(
            "fault",
            "NaNOutputOnce",
            {
                NAN_AT_ENV: "3",
                "KEMPNERFORGE_FAULT_HOSTS_FILE": str(where["fault"] / "fault-hosts"),
                "MAX_RESTARTS": "1",
            },
            "--train.max_steps=50",
            "--train.max_hardware_faults=1",
        ),
        "hang": submit(
            "hang",
            "SleepOnOneRank",
            {SLEEP_RANK_ENV: "0", SLEEP_AT_ENV: "3"},
            "--train.max_steps=50",
            "--train.hang_timeout_s=3",
        ),
        # Rank 1 of two is SIGKILLed at step 5 in every launch: the memory tier's copy of
        # step 4 brings the requeued run back there, and MAX_CRASH_RESTARTS=1 stops the
        # second crash.
        "killed": submit(
            "killed",
            "KillEveryLaunchAt",
            {
                "GPUS_PER_NODE": "2",
                "KF_TEST_KILL_AT": "5",
                "KF_TEST_KILL_RANK": "1",
                "KF_TEST_KILL_ARMED": str(where["killed"] / "armed"),
                "KEMPNERFORGE_CRASHES_FILE": str(where["killed"] / "crashes"),
                "MAX_CRASH_RESTARTS": "1",
            },
            "--train.max_steps=50",
            "--checkpoint.interval=0",
            "--checkpoint.memory_interval=2",
            f"--checkpoint.memory_dir={where['killed'] / 'shm'}",
        ),
    }
    yield submitted  # the tests add the jobs the script submitted itself
    for job, _ in submitted.values():
        slurm.run("scancel", str(job))


def _requeued(slurm: SlurmCluster, job: int, log_dir: pathlib.Path) -> dict[str, str]:
    """Wait for the script's requeue: the job back to PENDING, restarted once; its record."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        record = slurm.job(job)
        if record.get("Restarts") == "1" and record.get("JobState") == "PENDING":
            return record
        assert record.get("JobState") not in ENDED, _log(log_dir, job)
        assert time.monotonic() < deadline, (record, _log(log_dir, job))
        time.sleep(0.5)


def test_a_nan_abort_is_not_requeued_and_the_job_fails_with_its_code(slurm, fault_jobs):
    """Exit 3 (a diverged loss): resubmitting unchanged diverges again, so the script
    stops, and SLURM shows the job FAILED with exit code 3."""
    job, where = fault_jobs["nan"]
    record = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    log = _log(where, job)
    assert record["JobState"] == "FAILED", log
    assert record["ExitCode"] == f"{exit_codes.NAN_ABORT}:0" and record["Restarts"] == "0"
    assert "stopped on non-finite losses: change the run before resuming (no requeue)" in log
    assert "Traceback" not in log


def test_a_hardware_fault_moves_the_run_to_a_job_without_the_host_named(slurm, fault_jobs):
    """Exit 76: the run names its host in the fault-hosts file. SLURM refuses to change the
    excluded nodes of a running job ("Job is no longer pending execution"), so the script
    submits the run's next job, which excludes the host, waits for this one to end and
    appends to the same log; this job completes. The test cluster's other node is drained,
    so the new job waits, with SLURM's record showing what was asked. Let onto this node
    after all, it runs the same run as restart 1, meets the same (injected) fault, and
    MAX_RESTARTS=1, counted across the jobs, stops it: FAILED with exit code 76."""
    job, where = fault_jobs["fault"]
    record = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    log = _log(where, job)
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "0", log
    assert (where / "fault-hosts").read_text().split() == [slurm.node]
    [fault] = events(where / "run", "suspected_hardware_fault")
    assert fault["step"] == 4 and fault["host"].split(".")[0] == slurm.node
    line = f"suspected hardware faults on {slurm.node}: the run goes on in job "
    assert line in log, log
    new_job = int(log.split(line)[1].split(",")[0])
    fault_jobs["resubmitted"] = (new_job, where)
    pending = slurm.job(new_job)
    # Until the scheduler's next pass after the old job's end, the reason is still its
    # dependency on that job; then it is the nodes the job may not have.
    deadline = time.monotonic() + 60
    while pending["Reason"].startswith("Dependency") and time.monotonic() < deadline:
        time.sleep(1)
        pending = slurm.job(new_job)
    assert pending["JobState"] == "PENDING" and pending["ExcNodeList"] == slurm.node, pending
    assert pending["Reason"].startswith("ReqNodeNotAvail"), pending
    assert pending["StdOut"] == record["StdOut"] and pending["Command"] == SCRIPT
    assert pending["Partition"] == record["Partition"]
    assert pending["TimeLimit"] == record["TimeLimit"]
    let_in = slurm.run("scontrol", "update", f"JobId={new_job}", f"ExcNodeList={DRAINED_NODE}")
    assert let_in.returncode == 0, let_in.stderr
    again = slurm.wait_for(new_job, ENDED, JOB_TIMEOUT_S)
    log = _log(where, job)
    assert again["JobState"] == "FAILED" and again["ExitCode"] == "76:0", log
    assert f"job {new_job} restart 1 on {slurm.node}" in log
    assert log.rstrip().endswith("hardware faults, but already restarted 1 times: not requeueing")


def test_a_hang_requeues_the_job_with_every_stack_written(slurm, fault_jobs):
    """Exit 77: a step outlived train.hang_timeout_s; the stacks are in the run's hangs/
    folder and the job is requeued (a lost node is the usual cause)."""
    job, where = fault_jobs["hang"]
    _requeued(slurm, job, where)
    log = _log(where, job)
    assert "a step hung: every rank's stacks are in the run directory's hangs/ folder" in log
    assert f"hung: requeueing job {job}" in log
    [stacks] = (where / "run" / "hangs").iterdir()
    assert "sleep_through_the_collective" in stacks.read_text()


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
    resumes to the end with every step's loss equal to an uninterrupted run's. Two ranks
    (FSDP) on the node, as GPUS_PER_NODE=2 asks: SLURM's signal reaches both through srun
    and torchrun. The log says so in one line each, with no traceback."""
    steps = ["--train.max_steps=150"]
    two_ranks = {"GPUS_PER_NODE": "2"}
    whole_dir, preempted_dir = tmp_path / "whole", tmp_path / "preempted"
    whole = _submit(slurm, tmp_path, *_tiny(whole_dir, token_dirs, *steps), env=two_ranks)
    slurm.wait_for(whole, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    job = _submit(slurm, tmp_path, *_tiny(preempted_dir, token_dirs, *steps), env=two_ranks)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (preempted_dir / "metrics.jsonl").exists() or len(_losses(preempted_dir)) < 3:
        running = slurm.job(job).get("JobState") in ("PENDING", "RUNNING")
        assert running and time.monotonic() < deadline, _log(tmp_path, job)
        time.sleep(0.2)
    assert slurm.run("scancel", "--batch", "--signal=USR1", str(job)).returncode == 0
    _requeued(slurm, job, tmp_path)
    # Pending with Reason=None for a moment, then held until its begin time.
    held = slurm.wait_until(job, lambda record: record["Reason"] != "None", 30.0)
    assert held["Reason"] == "BeginTime" and held["JobState"] == "PENDING", held
    _release(slurm, job)
    done = slurm.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED"}, JOB_TIMEOUT_S)
    log = _log(tmp_path, job)
    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", log
    assert "saved after a stop signal: requeueing job" in log
    assert log.count("torchrun: stopped by SIGUSR1") == 1
    assert "Traceback" not in log and "death signal" not in log
    assert f"job {job} restart 1 on" in log and "(1 nodes x 2 ranks)" in log
    assert _losses(preempted_dir) == _losses(whole_dir)


def test_the_time_limit_warning_saves_and_requeues_until_max_restarts(slurm, fault_jobs):
    """--time=1 with --signal=B:USR1@5: SLURM warns the batch shell before its limit, the
    run saves and exits 75, and the script requeues; the restart resumes from that save.
    At the second warning MAX_RESTARTS=1 is reached: the job ends FAILED with exit code 75
    instead of being requeued again, and SLURM's own kill never came."""
    job, where = fault_jobs["limit"]
    _requeued(slurm, job, where)
    first = _log(where, job)
    assert "received SIGUSR1: asking the training step to save and stop" in first
    [saved] = [e["step"] for e in events(where / "run", "checkpoint")]
    _release(slurm, job)
    record = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    log = _log(where, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "75:0", log
    assert "saved, but already restarted 1 times: not requeueing" in log
    assert log.count("received SIGUSR1") == 2 and "DUE TO TIME LIMIT" not in log
    assert "Traceback" not in log
    [resumed] = events(where / "run", "resume")
    [first_save, second_save] = [e["step"] for e in events(where / "run", "checkpoint")]
    assert first_save == saved and resumed["step"] == saved and second_save > saved
    assert sorted(_losses(where / "run")) == list(range(1, second_save + 1))


def test_a_rank_killed_by_a_signal_is_requeued_until_max_crash_restarts(slurm, fault_jobs):
    """128+N: rank 1 of two SIGKILLed (as the out-of-memory killer does) at step 5. The
    script requeues the job, and the restart resumes from the memory tier's copy of step 4
    in the node's shared memory; killed there again, the second crash is past
    MAX_CRASH_RESTARTS=1: FAILED with exit code 137, in the same log."""
    job, where = fault_jobs["killed"]
    _requeued(slurm, job, where)
    first = _log(where, job)
    assert f"a rank was killed by signal 9 (crash 1 of 1): requeueing job {job}" in first
    _release(slurm, job)
    record = slurm.wait_for(job, ENDED, JOB_TIMEOUT_S)
    log = _log(where, job)
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "137:0", log
    assert record["Restarts"] == "1", record
    assert "a rank was killed by signal 9, 2 times in this job: not requeueing" in log
    assert (where / "crashes").read_text().split() == ["2"]
    [resume] = events(where / "run", "resume")
    assert resume["step"] == 4 and "memory tier" in resume["path"], resume
    assert sorted(set(_losses(where / "run"))) == [1, 2, 3, 4, 5]
