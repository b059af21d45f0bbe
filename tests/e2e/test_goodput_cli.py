"""End to end: a real run stopped by SIGTERM (exit 75, the requeue code) and resumed, then
`kempnerforge goodput` on its directory."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from kempnerforge.metrics.goodput import CAUSES, account_rows
from tests.support.cli import run_kempnerforge
from tests.support.metrics_rows import read_rows, train_rows
from tests.support.threads import PROCESS_THREADS
from tests.support.warm_process import popen

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
# debug.toml shrunk: small batches, every step logged, an eval and a save every 2 steps.
SHRUNK = [
    "--train.batch_size=2",
    "--train.seq_len=64",
    "--train.sample_prompt=",
    "--metrics.log_interval=1",
    "--metrics.progress=off",
    "--eval.interval=2",
    "--eval.steps=2",
    "--checkpoint.interval=2",
]
# Sums of the same floats in the same order on both sides, a few of them: a few ulps.
SUM_TOLERANCE = 1e-12


def test_goodput_attributes_the_stop_the_restart_and_the_start_ups(tmp_path, builtin_cache):
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "OMP_NUM_THREADS": PROCESS_THREADS,
        "KEMPNERFORGE_CACHE": str(builtin_cache),
    }
    args = [sys.executable, "-m", "kempnerforge", "train", DEBUG, *SHRUNK]
    first = popen(
        [*args, "--train.max_steps=10000", f"--train.run_dir={run_dir}"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(train_rows(run_dir, live=True)) < 4:
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=300)
    assert first.returncode == 75, err[-3000:]
    stopped_at = train_rows(run_dir)[-1]["step"]
    second = run_kempnerforge(
        "train",
        DEBUG,
        *SHRUNK,
        f"--train.max_steps={stopped_at + 2}",
        f"--train.run_dir={run_dir}",
        env_extra={"OMP_NUM_THREADS": PROCESS_THREADS, "KEMPNERFORGE_CACHE": str(builtin_cache)},
    )
    assert second.returncode == 0, second.stderr[-3000:]

    result = run_kempnerforge("goodput", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    causes = {k: v["seconds"] for k, v in report["causes"].items()}
    assert set(causes) == set(CAUSES) and report["num_processes"] == 2

    rows = read_rows(run_dir)
    starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
    assert len(starts) == 2 and starts[0] == 0  # each launch's first row
    # The gap: the first process's last row to the second's start.
    gap = rows[starts[1]]["started"] - rows[starts[1] - 1]["time"]
    assert gap > 0 and causes["restart_gap"] == pytest.approx(gap, rel=SUM_TOLERANCE)
    # Each start-up: the command's start to its first step's start.
    startup = 0.0
    for i in starts:
        first_row = next(r for r in rows[i:] if "step_time_s" in r)
        startup += first_row["time"] - first_row["step_time_s"] - rows[i]["started"]
    assert causes["startup"] == pytest.approx(startup, rel=SUM_TOLERANCE)
    # The SIGTERM's save holds the stopped step: nothing is trained twice, and every row
    # (one step each) is a first time. Productive: their step time less their data waits.
    steps = train_rows(run_dir)
    assert [r["step"] for r in steps] == list(range(1, stopped_at + 3))
    assert causes["recomputed"] == 0.0
    productive = sum(r["step_time_s"] * (1 - r["data_wait_share"]) for r in steps)
    waits = sum(r["step_time_s"] * r["data_wait_share"] for r in steps)
    assert causes["productive"] == pytest.approx(productive, rel=SUM_TOLERANCE)
    assert causes["data_wait"] == pytest.approx(waits, rel=SUM_TOLERANCE, abs=1e-15)
    assert causes["eval"] > 0 and causes["checkpoint"] > 0
    assert sum(v["share"] for v in report["causes"].values()) == pytest.approx(1.0, abs=1e-12)
    assert report["total_s"] == pytest.approx(rows[-1]["time"] - rows[0]["started"])
    assert report["goodput"] == pytest.approx(productive / report["total_s"])
    # The last training row's running share is the account up to that row.
    last = max(i for i, r in enumerate(rows) if "step_time_s" in r)
    assert rows[last]["goodput"] == pytest.approx(account_rows(rows[: last + 1]).goodput)

    table = run_kempnerforge("goodput", str(run_dir))
    assert table.returncode == 0 and "unattributed" in table.stdout
    print(table.stdout)  # the measured breakdown, in the test's output


def test_a_run_killed_and_relaunched_is_accounted_to_within_1_percent_of_its_wall_time(
    tmp_path, builtin_cache
):
    """A known schedule of faults: SIGKILL at the end of step 11 (the memory tier copied
    step 10), a 1 s wait, the relaunch resumes from the copy and trains step 11 again. Every
    cause is worked out from the rows, and what no row accounts for stays under 1%."""
    run_dir = tmp_path / "run"
    armed = tmp_path / "armed"
    armed.write_text("")
    args = [
        "train", DEBUG, "--train.max_steps=16", f"--train.run_dir={run_dir}",
        "--train.batch_size=4", "--train.seq_len=128",
        "--train.sample_prompt=", "--metrics.log_interval=1", "--metrics.progress=off",
        "--eval.interval=8", "--eval.steps=2", "--checkpoint.interval=0",
        "--checkpoint.memory_interval=2", f"--checkpoint.memory_dir={tmp_path / 'shm'}",
        "--train.hooks=['tests.support.faults:KillOnceAt']",
    ]  # fmt: skip
    env = {
        "OMP_NUM_THREADS": PROCESS_THREADS,
        "KEMPNERFORGE_CACHE": str(builtin_cache),
        "KF_TEST_KILL_AT": "11",
        "KF_TEST_KILL_ARMED": str(armed),
    }
    killed = run_kempnerforge(*args, env_extra=env)
    assert killed.returncode == -signal.SIGKILL and not armed.exists(), killed.stderr[-3000:]
    time.sleep(1.0)
    relaunched = run_kempnerforge(*args, env_extra=env)
    assert relaunched.returncode == 0, relaunched.stderr[-3000:]

    rows = read_rows(run_dir)
    steps = train_rows(run_dir)
    assert [r["step"] for r in steps] == [*range(1, 12), *range(11, 17)]
    report = account_rows(rows)
    causes = report.seconds
    starts = [i for i, r in enumerate(rows) if r.get("event") == "start"]
    assert len(starts) == 2 and report.num_processes == 2
    gap = rows[starts[1]]["started"] - rows[starts[1] - 1]["time"]
    assert gap >= 1.0 and causes["restart_gap"] == pytest.approx(gap, rel=SUM_TOLERANCE)
    # Step 11 trained twice: its second row is the recomputed time, the rest productive.
    again = next(r for r in rows[starts[1] :] if "step_time_s" in r)
    assert again["step"] == 11
    assert causes["recomputed"] == pytest.approx(
        again["step_time_s"] * (1 - again["data_wait_share"]), rel=SUM_TOLERANCE
    )
    copies = [r for r in rows if r.get("event") in ("memory_copy", "checkpoint")]
    assert causes["checkpoint"] == pytest.approx(sum(r["seconds"] for r in copies), abs=1e-9)
    evals = [r["eval_time_s"] for r in rows if "eval_time_s" in r]
    assert len(evals) == 2 and causes["eval"] == pytest.approx(sum(evals), rel=SUM_TOLERANCE)
    assert report.total_s == pytest.approx(rows[-1]["time"] - rows[0]["started"])
    print(json.dumps(report.as_dict(), indent=1))  # the measured breakdown
    assert abs(causes["unattributed"]) <= 0.01 * report.total_s, causes
