"""The hang watchdog end to end: two CLI ranks, one of which stops answering in a hook."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kempnerforge.resilience import exit_codes
from tests.support.faults import SLEEP_AT_ENV, SLEEP_RANK_ENV
from tests.support.tiny import tiny_run
from tests.support.warm_process import popen

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

REPO = Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
LIMIT_S = 5
WAIT_S = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_ranks(run_dir: Path, overrides: list[str], env_extra: dict[str, str]) -> list:
    """Two `kempnerforge train` processes forming one gloo world, as torchrun would start
    them, but each with its own exit code."""
    port = str(_free_port())
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "KEMPNERFORGE_EXIT_CODE_FILE": str(run_dir.parent / "exit"),
            **env_extra,
        }
        log = open(run_dir.parent / f"rank{rank}.log", "w")  # noqa: SIM115 (the child's)
        procs.append(
            popen(
                [sys.executable, "-m", "kempnerforge", "train", DEBUG, *overrides],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
    return procs


def test_a_rank_that_stops_answering_ends_every_rank_with_77_and_their_stacks(tmp_path, token_dirs):
    run_dir = tmp_path / "run"
    overrides = tiny_run(
        run_dir,
        token_dirs,
        "--train.max_steps=1000",
        "--model.n_kv_heads=2",
        "--distributed.dp_shard=2",
        f"--train.hang_timeout_s={LIMIT_S}",
        "--train.hooks=['tests.support.faults:SleepOnOneRank']",
    )
    started = time.monotonic()
    procs = _start_ranks(run_dir, overrides, {SLEEP_RANK_ENV: "1", SLEEP_AT_ENV: "3"})
    codes = [proc.wait(timeout=WAIT_S) for proc in procs]
    elapsed = time.monotonic() - started
    logs = [(tmp_path / f"rank{r}.log").read_text() for r in (0, 1)]
    assert codes == [exit_codes.HANG, exit_codes.HANG], logs
    assert (tmp_path / "exit").read_text() == f"{exit_codes.HANG}\n"  # rank 0's, recorded
    hangs = {p.name: p.read_text() for p in (run_dir / "hangs").iterdir()}
    host = socket.gethostname()
    assert sorted(hangs) == [f"rank0-{host}.txt", f"rank1-{host}.txt"]
    # Rank 1 hangs in its hook at the end of step 3; rank 0 waits for it in step 4.
    sleeping, waiting = hangs[f"rank1-{host}.txt"], hangs[f"rank0-{host}.txt"]
    assert f"rank 1 on {host}: step 3 has run " in sleeping
    assert f"past its limit of {LIMIT_S:.1f} s (train.hang_timeout_s = {LIMIT_S})" in sleeping
    assert " in sleep_through_the_collective" in sleeping and " in on_step_end" in sleeping
    assert f"rank 0 on {host}: step 4 has run " in waiting
    assert " in all_reduce" in waiting and " in step_tokens" in waiting
    assert "Thread 0x" in waiting  # every thread, the watchdog's own included
    # Both noticed within the limit and its grace (one limit more), plus the start-up.
    assert "hang: rank 0 on" in logs[0] and "hang: rank 1 on" in logs[1]
    assert elapsed < WAIT_S
