"""The node launcher of the SLURM script (kempnerforge.launch.node_torchrun) under real
torchrun: once a rank fails, the node's other ranks get FAILURE_GRACE_S to exit before
SIGKILL, not torchrun's 30 s; when a rank exited PREEMPTED (75) they keep the 30 s to
finish their part of the save."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from kempnerforge.launch.node_torchrun import FAILURE_GRACE_S
from tests.support import warm_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
SLOW_RANK_S = FAILURE_GRACE_S + 4
"""How long rank 1 goes on after SIGTERM: past the failure grace, well within 30 s."""

RANKS = f"""
import os, pathlib, signal, sys, time

out, code = pathlib.Path(sys.argv[1]), int(sys.argv[2])
if os.environ["RANK"] == "0":
    while not (out / "ready").exists():
        time.sleep(0.05)
    sys.exit(code)
signal.signal(signal.SIGTERM, lambda *_: None)  # a rank still saving, or frozen
(out / "ready").write_text("")
time.sleep(1.0)  # torchrun's SIGTERM arrives in here, after rank 0's exit
deadline = time.monotonic() + {SLOW_RANK_S}
while time.monotonic() < deadline:
    time.sleep(0.1)
(out / "finished").write_text("")
"""


def _launch(tmp_path: Path, code: int) -> tuple[int, bool]:
    """Rank 0 exits ``code`` once rank 1 runs; rank 1 ignores SIGTERM for SLOW_RANK_S.
    Returns the launcher's exit code and whether rank 1 lived to finish."""
    out = tmp_path / f"exit-{code}"
    out.mkdir()
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    command = [
        sys.executable, "-m", "kempnerforge.launch.node_torchrun", "--standalone",
        "--nproc_per_node=2", "--max_restarts=0", str(script), str(out), str(code),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = warm_process.run(command, env=env, capture_output=True, text=True, timeout=120)
    return done.returncode, (out / "finished").exists()


def test_a_failed_rank_gets_the_others_killed_after_a_short_grace(tmp_path):
    code, finished = _launch(tmp_path, 77)
    assert code == 1 and not finished  # SIGKILLed after FAILURE_GRACE_S


def test_a_preempted_rank_leaves_the_others_time_to_finish_their_save(tmp_path):
    code, finished = _launch(tmp_path, 75)
    assert code == 1 and finished
