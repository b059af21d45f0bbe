"""The memory tier under torchrun: one worker of a 2-rank FSDP job killed with SIGKILL between
persistent checkpoints, the job ends (torchrun restarts nothing in place: --max_restarts=0,
as the SLURM scripts run it), and the relaunch resumes from the newest copy both ranks hold
in the node's shared memory (a folder of the test's here): the steps since the copy are
lost, no more, and the losses are those of an uninterrupted run, bitwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.metrics_rows import events, train_rows
from tests.support.tiny import tiny_run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = Path(__file__).parents[2]
DEBUG = REPO / "configs" / "train" / "debug.toml"
KILLER = """
import os
import signal

from kempnerforge.training.hooks import TrainingHook


class KillRank1AtStep7(TrainingHook):
    def on_step_end(self, ctx):
        if ctx.step == 7 and os.environ.get("RANK") == "1" and os.path.exists("kill_once"):
            os.remove("kill_once")
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _torchrun(tmp_path: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}:{tmp_path}"}
    args = tiny_run(
        tmp_path / name, None, "--train.max_steps=10", "--train.deterministic=true",
        "--model.n_kv_heads=2", "--distributed.dp_shard=2", "--checkpoint.memory_interval=2",
        f"--checkpoint.memory_dir={tmp_path / 'shm'}", "--checkpoint.interval=0",
        "--optimizer.lr=3e-3", "--eval.interval=0", *extra,
    )  # fmt: skip
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "--max_restarts=0", "-m", "kempnerforge", "train", str(DEBUG), *args,
    ]  # fmt: skip
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )


def test_a_killed_worker_restarts_from_the_memory_tier(tmp_path):
    (tmp_path / "killer_hook.py").write_text(KILLER)
    whole = _torchrun(tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    (tmp_path / "kill_once").write_text("")
    hook = "--train.hooks=['killer_hook:KillRank1AtStep7']"
    killed = _torchrun(tmp_path, "killed", hook)
    assert killed.returncode != 0 and not (tmp_path / "kill_once").exists()
    relaunched = _torchrun(tmp_path, "killed", hook)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]

    want = {r["step"]: r for r in train_rows(tmp_path / "whole")}
    rows = train_rows(tmp_path / "killed")
    # Steps 1-7, then from the copy of step 6: 7 again and on.
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6, 7, 7, 8, 9, 10]
    for row in rows:
        step = row["step"]
        assert (row["loss"], row["grad_norm"]) == (want[step]["loss"], want[step]["grad_norm"])
    (resume,) = events(tmp_path / "killed", "resume")
    assert resume["step"] == 6 and "memory tier" in resume["path"]
    assert not any((tmp_path / "shm").iterdir()), "the finished run removed its copies"
