"""Jobs of replica groups in tests: a lighthouse and groups as CLI subprocesses that can be
killed, on ports chosen free at run time, and what their metrics say."""

from __future__ import annotations

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import torch

from kempnerforge.training.hooks import StepContext, TrainingHook
from tests.support.metrics_rows import read_rows, train_rows
from tests.support.tiny import tiny_run
from tests.support.warm_process import Process, popen

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
DEBUG_MOE = str(REPO / "configs" / "train" / "debug_moe.toml")
PAUSE_ENV = "KF_TEST_STEP_PAUSE_S"
"""How long each step of a group pauses (SlowSteps; default 0.5 s): the test's kills and
relaunches then land mid-run on a loaded 2-core machine too."""
SLOW_WHILE_ENV = "KF_TEST_SLOW_WHILE"
"""A file: SlowSteps pauses only while it exists (always when the variable is unset), so a
test that has done its kills and relaunches lets the groups finish at full speed."""
HOLD_START_ENV = "KF_TEST_HOLD_START_WHILE"
"""A file: a group starting while it exists waits (in SlowSteps' constructor, before its
first quorum) until it is gone, so a test decides when a relaunched group comes back."""


class SlowSteps(TrainingHook):
    """Pause after each step, so a run lasts long enough to be killed and rejoined; at
    start-up, wait while the HOLD_START_ENV file exists."""

    def __init__(self) -> None:
        hold = os.environ.get(HOLD_START_ENV)
        while hold is not None and os.path.exists(hold):
            time.sleep(0.1)

    def on_step_end(self, ctx: StepContext) -> None:
        slow_while = os.environ.get(SLOW_WHILE_ENV)
        if slow_while is None or os.path.exists(slow_while):
            time.sleep(float(os.environ.get(PAUSE_ENV, "0.5")))


class RouterBiases(TrainingHook):
    """After each step, save the sigmoid routers' expert biases to
    ``$KF_TEST_BIAS_DIR/g<replica group>-step<step>.pt``, for comparing groups."""

    def on_step_end(self, ctx: StepContext) -> None:
        biases = [
            m.expert_bias.detach().clone()
            for m in ctx.model.modules()
            if getattr(m, "expert_bias", None) is not None
        ]
        group = os.environ["KEMPNERFORGE_REPLICA_GROUP"]
        path = pathlib.Path(os.environ["KF_TEST_BIAS_DIR"]) / f"g{group}-step{ctx.step}.pt"
        torch.save(biases, path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_lighthouse(port: int, join_timeout_ms: int = 200, *, fresh: bool = False) -> Process:
    """`kempnerforge lighthouse` on ``port``: quorums form ``join_timeout_ms`` after the
    first group asks (0.2 s by default), and a group silent for 1 s is left out. Forked
    from the warm server, or a fresh interpreter when ``fresh``: a restarted lighthouse is
    then away for its start-up, long enough for the groups' next quorum to fail (a forked
    one is back before they notice), as test_a_lighthouse_restarted_mid_run_costs_no_step
    needs."""
    launch = subprocess.Popen if fresh else popen
    process = launch(
        [
            sys.executable, "-m", "kempnerforge", "lighthouse", f"--port={port}",
            "--min-replicas=1", f"--join-timeout-ms={join_timeout_ms}",
            "--heartbeat-timeout-ms=1000",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    # Its join timeout first, then its address once it serves.
    for _ in range(2):
        line = process.stdout.readline() if process.stdout else ""
        assert line.startswith("lighthouse: "), line
    assert line.startswith("lighthouse: http"), line
    return process


def group_args(
    job_dir: pathlib.Path, data: tuple[str, str], port: int, *extra: str, num_groups: int = 2
) -> list[str]:
    """The tiny model's run as one of ``num_groups`` replica groups (a slot of 4 x 32 tokens
    each)."""
    return [
        DEBUG,
        *tiny_run(
            job_dir,
            data,
            "--model.n_kv_heads=2",
            "--train.deterministic=true",
            "--train.sample_tokens=0",
            "--eval.interval=0",
            "--fault_tolerance.enabled=true",
            f"--fault_tolerance.num_replica_groups={num_groups}",
            f"--fault_tolerance.lighthouse=http://localhost:{port}",
            "--fault_tolerance.timeout_s=20",
            "--train.hooks=['tests.support.replica_groups:SlowSteps']",
            *extra,
        ),
    ]


def start_group(
    group: int,
    args: list[str],
    log: pathlib.Path,
    processes: int = 1,
    pause_s: float = 0.5,
    slow_while: pathlib.Path | None = None,
) -> Process:
    """`kempnerforge train` as replica group ``group`` (under torchrun for several
    ``processes``), pausing ``pause_s`` after each step (while ``slow_while`` exists, when
    given); its output goes to ``log``."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "KEMPNERFORGE_REPLICA_GROUP": str(group),
        PAUSE_ENV: str(pause_s),
        **({SLOW_WHILE_ENV: str(slow_while)} if slow_while is not None else {}),
    }
    launcher = [sys.executable]
    if processes > 1:
        launcher += [
            "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
            "--max_restarts=0",
        ]  # fmt: skip
    with open(log, "a") as out:
        return popen(
            [*launcher, "-m", "kempnerforge", "train", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for_step(run_dir: pathlib.Path, step: int, process: Process, limit_s=120.0):
    """Block until ``run_dir`` logged a training row at ``step`` or later."""
    deadline = time.monotonic() + limit_s
    while not any(r["step"] >= step for r in train_rows(run_dir, live=True)):
        assert process.poll() is None, f"the group exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{run_dir} never reached step {step}"
        time.sleep(0.05)


def finish(process: Process, log: pathlib.Path, limit_s: float = 180.0) -> None:
    """Wait for a group to end; fail with its log's tail unless it exited 0."""
    try:
        code = process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        process.kill()
        code = process.wait()
    assert code == 0, f"exit {code}:\n" + log.read_text()[-4000:]


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (torchrun's ranks), from /proc."""
    children: list[int] = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        children += [int(c) for c in text]
    return children


def kill(process: Process) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait()


class ReplicaJob:
    """A test's lighthouse and its replica groups (two unless ``num_groups``) of
    ``processes`` each, every one of them killed when the ``with`` block ends, whatever the
    test asserted; ``join_timeout_ms`` is the lighthouse's.

    Group g runs in ``job_dir / f"replica_{g}"`` and logs to ``job_dir / f"g{g}.log"``
    (appended to across relaunches).
    """

    def __init__(
        self,
        job_dir: pathlib.Path,
        data: tuple[str, str],
        *extra: str,
        processes: int = 1,
        pause_s: float = 0.5,
        num_groups: int = 2,
        join_timeout_ms: int = 200,
    ) -> None:
        self.dir = job_dir
        self.port = free_port()
        self.args = group_args(job_dir, data, self.port, *extra, num_groups=num_groups)
        self.logs = [job_dir / f"g{g}.log" for g in range(num_groups)]
        self.join_timeout_ms = join_timeout_ms
        self.groups: dict[int, Process] = {}
        self.processes = processes
        self.pause_s = pause_s
        self.slow_while = job_dir / "slow_steps"
        """The groups pause after each step while this file exists: until finish()."""
        self.slow_while.touch()
        self.lighthouse = start_lighthouse(self.port, join_timeout_ms)

    def __enter__(self) -> ReplicaJob:
        return self

    def __exit__(self, *exc: object) -> None:
        for process in self.groups.values():
            process.kill()
        self.lighthouse.kill()

    def start(self, *groups: int) -> None:
        """Launch (or relaunch) ``groups``."""
        for g in groups:
            self.groups[g] = start_group(
                g, self.args, self.logs[g], self.processes, self.pause_s, self.slow_while
            )

    def run_dir(self, group: int) -> pathlib.Path:
        return self.dir / f"replica_{group}"

    def wait_for_step(self, group: int, step: int) -> None:
        wait_for_step(self.run_dir(group), step, self.groups[group])

    def restart_lighthouse(self) -> None:
        """Kill the lighthouse and start a new one on the same port."""
        kill(self.lighthouse)
        self.lighthouse = start_lighthouse(self.port, self.join_timeout_ms, fresh=True)

    def finish(self) -> None:
        """Wait for every running group to exit 0 (fail with its log's tail otherwise).

        The test's kills and relaunches are over: once every running group has logged a
        step since this call (a relaunched or resumed group has joined the others), the
        groups stop pausing and train the rest at full speed."""
        logged = {g: len(train_rows(self.run_dir(g), live=True)) for g in self.groups}
        deadline = time.monotonic() + 120.0
        for g, process in sorted(self.groups.items()):
            run_dir = self.run_dir(g)
            while len(train_rows(run_dir, live=True)) <= logged[g] and process.poll() is None:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        self.slow_while.unlink(missing_ok=True)
        for g, process in sorted(self.groups.items()):
            finish(process, self.logs[g])

    def log(self, group: int) -> str:
        return self.logs[group].read_text()


def losses(run_dir: pathlib.Path, *, live: bool = False) -> dict[int, float]:
    """Each logged step's loss (the last row of a step logged twice, after a restart);
    ``live``: of a run still going."""
    return {r["step"]: r["loss"] for r in train_rows(run_dir, live=live)}


def replica_steps(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    """The group's committed attempts: data step, participants, its rank and slots."""
    return [r for r in read_rows(run_dir, live=True) if r.get("event") == "replica_step"]
