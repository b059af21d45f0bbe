"""The memory tier under torchrun: one worker of a 2-rank FSDP job killed with SIGKILL between
persistent checkpoints, the job ends (torchrun restarts nothing in place: --max_restarts=0,
as the SLURM scripts run it), and the relaunch resumes from the newest copy both ranks hold
in the node's shared memory (a folder of the test's here): the steps since the copy are
lost, no more, and the losses are those of an uninterrupted run, bitwise.

Then two "nodes" on this machine, each its own torchrun of one rank with a shared-memory
folder of its own: one node's processes are killed and its folder removed (the node is
gone), and the relaunch resumes every rank from the same step, the lost node's rank from
the copy its peer node kept."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import warm_process
from tests.support.metrics_rows import events, train_rows
from tests.support.tiny import tiny_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).parents[2]
DEBUG = REPO / "configs" / "train" / "debug.toml"
KILL_AT_STEP_7 = {"KF_TEST_KILL_AT": "7", "KF_TEST_KILL_RANK": "1"}
"""The fault hooks' settings (tests/support/faults.py): rank 1, at the end of step 7."""


def _args(tmp_path: Path, name: str, shm: Path, *extra: str) -> list[str]:
    args = tiny_run(
        tmp_path / name, None, "--train.max_steps=10", "--train.deterministic=true",
        "--model.n_kv_heads=2", "--distributed.dp_shard=2", "--checkpoint.memory_interval=2",
        f"--checkpoint.memory_dir={shm}", "--checkpoint.interval=0",
        "--optimizer.lr=3e-3", "--eval.interval=0", *extra,
    )  # fmt: skip
    return ["-m", "kempnerforge", "train", str(DEBUG), *args]


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        **os.environ,
        **KILL_AT_STEP_7,
        "KF_TEST_KILL_ARMED": str(tmp_path / "kill_once"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
    }


def _torchrun(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "--max_restarts=0", *_args(tmp_path, name, tmp_path / "shm", *extra),
    ]  # fmt: skip
    return warm_process.run(
        command, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600
    )


def _two_nodes(tmp_path: Path, name: str, *extra: str) -> list[tuple[int, str]]:
    """The job on two "nodes": a torchrun of one rank each, meeting at a port of this
    machine, node N's shared memory in tmp_path/shm-N. Each node's (exit code, stderr)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = []
    for node in (0, 1):
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
            "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
            "--max_restarts=0", *_args(tmp_path, name, tmp_path / f"shm-{node}", *extra),
        ]  # fmt: skip
        nodes.append(
            warm_process.popen(
                command, cwd=tmp_path, env=_env(tmp_path), stderr=subprocess.PIPE, text=True
            )
        )
    return [(job.wait(timeout=600), job.communicate()[1]) for job in nodes]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict]:
    """The 2-rank run without faults: each step's training row."""
    tmp_path = tmp_path_factory.mktemp("whole")
    whole = _torchrun(tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    return {r["step"]: r for r in train_rows(tmp_path / "whole")}


def test_a_killed_worker_restarts_from_the_memory_tier(tmp_path, uninterrupted):
    (tmp_path / "kill_once").write_text("")
    hook = "--train.hooks=['tests.support.faults:KillOnceAt']"
    killed = _torchrun(tmp_path, "killed", hook)
    assert killed.returncode != 0 and not (tmp_path / "kill_once").exists()
    relaunched = _torchrun(tmp_path, "killed", hook)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]

    want = uninterrupted
    rows = train_rows(tmp_path / "killed")
    # Steps 1-7, then from the copy of step 6: 7 again and on.
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10]
    for row in rows:
        step = row["step"]
        assert (row["loss"], row["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"])
    (resume,) = events(tmp_path / "killed", "resume")
    assert resume["step"] == 6 and "memory tier" in resume["path"]
    assert not any((tmp_path / "shm").iterdir()), "the finished run removed its copies"


def test_a_lost_node_restarts_from_the_copy_its_peer_node_kept(tmp_path, uninterrupted):
    (tmp_path / "kill_once").write_text("")
    hook = "--train.hooks=['tests.support.faults:KillNodeOnceAt']"
    killed = _two_nodes(tmp_path, "lost", hook)
    assert all(code != 0 for code, _ in killed) and not (tmp_path / "kill_once").exists()
    # Each node kept its own copies of steps 4 and 6 and its peer's.
    for node in (0, 1):
        names = sorted(p.name for p in (tmp_path / f"shm-{node}").rglob("*.pt"))
        assert names == sorted([f"rank_{node}.pt", f"peer_{1 - node}.pt"] * 2), names
    shutil.rmtree(tmp_path / "shm-1")  # the node is gone, and its memory with it
    relaunched = _two_nodes(tmp_path, "lost", hook)
    assert [code for code, _ in relaunched] == [0, 0], relaunched[1][1][-3000:]
    assert "rank 1 held no copy of step 6" in relaunched[1][1]
    assert "took the one rank 0 kept" in relaunched[1][1]

    rows = train_rows(tmp_path / "lost")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10]
    for row in rows:
        step = row["step"]
        want = uninterrupted[step]
        assert (row["loss"], row["grad_norm"]) == (want["loss"], want["grad_norm"]), step
    (resume,) = events(tmp_path / "lost", "resume")
    assert resume["step"] == 6 and "memory tier" in resume["path"]
    for node in (0, 1):  # the finished run removed its copies and the ones it kept
        assert not list((tmp_path / f"shm-{node}").rglob("*.pt"))
