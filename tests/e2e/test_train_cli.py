"""End to end: `kempnerforge train configs/train/debug.toml` as a user runs it."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.support.metrics_rows import train_rows
from tests.support.threads import PROCESS_THREADS
from tests.support.warm_process import popen

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
DEBUG_MOE = str(REPO / "configs" / "train" / "debug_moe.toml")


def kempnerforge(*args: str, env_extra: dict | None = None, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": PROCESS_THREADS, **(env_extra or {})}
    return popen(
        [sys.executable, "-m", "kempnerforge", *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def run(*args: str, cache: pathlib.Path, timeout: float = 400) -> subprocess.CompletedProcess:
    proc = kempnerforge(*args, env_extra={"KEMPNERFORGE_CACHE": str(cache)})
    out, err = proc.communicate(timeout=timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def cache(builtin_cache) -> pathlib.Path:
    return builtin_cache


def test_debug_run_trains_then_resumes_from_latest(tmp_path, cache):
    run_dir = tmp_path / "run"
    common = [
        f"--train.run_dir={run_dir}",
        "--metrics.log_interval=1",
        "--metrics.progress=plain",
        "--train.sample_tokens=20",
    ]
    first = run("train", DEBUG, "--train.max_steps=30", *common, cache=cache)
    assert first.returncode == 0, first.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in ("loss", "grad_norm", "lr", "tokens_seen", "tokens_per_sec", "step_time_s"):
        assert key in rows[0]
    assert sum(r["loss"] for r in rows[-5:]) / 5 < sum(r["loss"] for r in rows[:5]) / 5 - 1.0
    assert (run_dir / "config.toml").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_30"
    assert (run_dir / "checkpoints" / "step_30" / "complete.json").is_file()
    assert "sample (greedy" in first.stdout and "def test_" in first.stdout

    second = run("train", DEBUG, "--train.max_steps=33", *common, cache=cache)
    assert second.returncode == 0, second.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 34))  # 31..33 appended, nothing redone
    assert rows[30]["tokens_seen"] == 31 * 8 * 256
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_33"


def test_debug_moe_config_trains_and_reports_its_routers(tmp_path, cache):
    run_dir = tmp_path / "run"
    result = run(
        "train",
        DEBUG_MOE,
        "--train.max_steps=30",
        "--train.seq_len=128",
        f"--train.run_dir={run_dir}",
        "--metrics.log_interval=5",
        "--metrics.progress=plain",
        "--train.sample_tokens=0",
        cache=cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = train_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 5, 10, 15, 20, 25, 30]
    assert rows[-1]["loss"] < rows[0]["loss"] - 1.0
    for row in rows:
        loads = row["moe/load"]
        # 4 MoE layers x 8 experts; every layer routes each token to 2 experts.
        assert len(loads) == 4 and all(len(layer) == 8 for layer in loads)
        assert all(sum(layer) == 2 * 8 * 128 for layer in loads)
        assert row["moe/dropped_share"] == 0.0  # dropless
        assert row["moe/imbalance"] >= 1.0 and row["moe/aux_loss"] > 0
        assert row["moe/z_loss"] > 0
    assert "moe aux" in result.stdout and "imbalance" in result.stdout
    # FLOPs count the active parameters: 3.55M of the 10.63M.
    assert "10.63M parameters" in result.stderr


def test_bad_config_exits_2_with_one_line_and_no_traceback(tmp_path, cache):
    result = run("train", DEBUG, "--train.max_stepz=3", f"--train.run_dir={tmp_path}", cache=cache)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("kempnerforge: error: train.max_stepz: unknown key")
    assert "did you mean 'max_steps'?" in lines[0]


def test_missing_data_path_exits_2_naming_the_directory(tmp_path, cache):
    missing = tmp_path / "nothing-here"
    result = run(
        "train", DEBUG, f"--data.path={missing}", f"--train.run_dir={tmp_path}", cache=cache
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert str(missing) in result.stderr


def test_sigterm_saves_a_checkpoint_and_exits_with_the_requeue_code(tmp_path, cache):
    run_dir = tmp_path / "run"
    proc = kempnerforge(
        "train",
        DEBUG,
        "--train.max_steps=10000",
        f"--train.run_dir={run_dir}",
        "--metrics.log_interval=1",
        "--metrics.progress=off",
        "--checkpoint.interval=0",
        env_extra={"KEMPNERFORGE_CACHE": str(cache)},
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if len(train_rows(run_dir, live=True)) >= 3:
            break
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-3000:]
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    step = int(latest.removeprefix("step_"))
    assert step >= 3
    assert train_rows(run_dir)[-1]["step"] == step
    assert "shutdown requested by SIGTERM" in err


def test_the_allocator_is_preloaded_by_a_restart_and_logged_once(tmp_path, cache):
    library = sorted(pathlib.Path("/usr/lib").glob("*/libc_malloc_debug.so.0"))
    assert library, "glibc's libc_malloc_debug.so.0 (a real preloadable library) not found"
    args = ["train", DEBUG, "--train.max_steps=2", f"--train.run_dir={tmp_path}"]
    args += ["--eval.interval=0", "--checkpoint.interval=0", "--train.sample_prompt="]
    args += ["--train.batch_size=2", "--train.seq_len=64"]  # steps slowed by the debug malloc
    env = {"KEMPNERFORGE_CACHE": str(cache), "KEMPNERFORGE_ALLOCATOR": str(library[0])}
    proc = kempnerforge(*args, env_extra=env)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    logged = [line for line in (out + err).splitlines() if "memory allocator:" in line]
    assert len(logged) == 1 and f"({library[0]}, preloaded;" in logged[0], logged
    assert "KEMPNERFORGE_ALLOCATOR names it" in logged[0]

    env["KEMPNERFORGE_ALLOCATOR"] = "glibc"
    proc = kempnerforge(*args, "--train.max_steps=3", env_extra=env)
    out, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    assert "memory allocator: glibc malloc tuned to reuse freed memory" in out + err
    assert "preloaded" not in out + err
