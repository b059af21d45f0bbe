"""End to end: the launches a user gets wrong, and what the command does about each.

A run already at its last step, a rejected launch, a stop signal while the run is still
being built, a killed run requeued at once, a hook file in the working directory, a full
disk, and `--help`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from kempnerforge.training.workspace import RUN_MARKER
from tests.support.metrics_rows import train_rows
from tests.support.small_disks import no_small_disks
from tests.support.tiny import tiny_run
from tests.support.warm_process import popen

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
WAIT_S = 240.0


def tiny(run_dir: pathlib.Path, token_dirs: tuple[str, str], *extra: str) -> list[str]:
    return [
        "train",
        DEBUG,
        *tiny_run(
            run_dir,
            token_dirs,
            "--model.n_kv_heads=2",
            "--scheduler.warmup_steps=1",
            "--eval.interval=0",
            *extra,
        ),
    ]


def cli(*args: str, cache: pathlib.Path | None = None, command: str = ""):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if cache is not None:
        env["KEMPNERFORGE_CACHE"] = str(cache)
    argv = [command] if command else [sys.executable, "-m", "kempnerforge"]
    return popen(
        [*argv, *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the test can signal it whole
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"no exit within {WAIT_S:.0f} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def run(*args: str, **kwargs) -> tuple[int, str, str]:
    return finish(cli(*args, **kwargs))


def train_steps(run_dir: pathlib.Path) -> list[int]:
    return [r["step"] for r in train_rows(run_dir, live=True)]


def one_line(err: str) -> str:
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.strip().splitlines() if line.startswith("kempnerforge:")]
    assert len(lines) == 1, err[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, token_dirs) -> pathlib.Path:
    """A tiny run trained to its train.max_steps = 2."""
    run_dir = tmp_path_factory.mktemp("finished") / "run"
    code, _, err = run(*tiny(run_dir, token_dirs, "--train.max_steps=2"))
    assert code == 0, err[-3000:]
    return run_dir


def test_a_run_already_at_max_steps_says_there_is_nothing_to_train(finished, token_dirs):
    before = (finished / "metrics.jsonl").read_text()
    code, out, err = run(*tiny(finished, token_dirs, "--train.max_steps=2"))
    assert code == 0, err[-3000:]
    assert out.startswith(
        f"nothing to train: {finished}/checkpoints/step_2 is already at train.max_steps = 2; "
        "raise --train.max_steps"
    )
    assert (finished / "metrics.jsonl").read_text() == before
    code, _, err = run(*tiny(finished, token_dirs, "--train.max_steps=1"))
    assert code == 2
    assert one_line(err).startswith(
        "kempnerforge: error: train.max_steps = 1: expected >= 2, the step of the checkpoint"
    )


@pytest.mark.parametrize(
    "bad",
    [
        "--optimizer.name=adamz",
        "--scheduler.name=cosin",
        '--train.hooks=["no_such_module:Hook"]',
        "--data.path=/no/such/data",
    ],
    ids=["optimizer", "scheduler", "hooks", "data"],
)
def test_a_rejected_launch_writes_nothing_and_the_run_still_reruns(
    bad, tmp_path, token_dirs, finished
):
    run_dir = tmp_path / "run"
    code, _, err = run(*tiny(run_dir, token_dirs, "--train.max_steps=2"))
    assert code == 0, err[-3000:]
    config = (run_dir / "config.toml").read_text()
    history = sorted(os.listdir(run_dir / "config_history"))
    started = time.monotonic()
    code, _, err = run(*tiny(run_dir, token_dirs, "--train.max_steps=3", bad))
    assert code == 2
    field = bad[2:].split("=")[0]
    assert one_line(err).startswith(f"kempnerforge: error: {field}")
    assert (run_dir / "config.toml").read_text() == config
    assert sorted(os.listdir(run_dir / "config_history")) == history
    assert train_steps(run_dir) == [1, 2]
    # The documented rerun of the run's own config still works.
    code, _, err = run("train", str(run_dir / "config.toml"), "--train.max_steps=3")
    assert code == 0, err[-3000:]
    assert train_steps(run_dir) == [1, 2, 3]
    assert time.monotonic() - started < WAIT_S


def test_a_stop_signal_during_the_build_exits_75_without_a_checkpoint(tmp_path):
    cache = tmp_path / "cache"  # empty: the build prepares the built-in corpus
    run_dir = tmp_path / "run"
    proc = cli(
        "train",
        DEBUG,
        f"--train.run_dir={run_dir}",
        "--metrics.progress=off",
        "--train.max_steps=5",
        cache=cache,
    )
    deadline = time.monotonic() + WAIT_S
    while not list(cache.glob("stdlib-*")):  # the preparation has started
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the corpus preparation never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 75, err[-3000:]
    assert "Traceback" not in err
    assert "stop requested by SIGTERM while the run was being built" in err
    checkpoints = run_dir / "checkpoints"
    assert not checkpoints.exists() or not list(checkpoints.glob("step_*"))


def test_a_run_killed_with_workers_alive_can_be_requeued_at_once(tmp_path, token_dirs):
    run_dir = tmp_path / "run"
    args = tiny(run_dir, token_dirs, "--data.num_workers=2", "--checkpoint.interval=2")
    proc = cli(*args, "--train.max_steps=100000")
    try:
        deadline = time.monotonic() + WAIT_S
        while len(train_steps(run_dir)) < 3:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no 3 logged steps"
            time.sleep(0.05)
        proc.kill()  # SIGKILL to the main process only: its workers are orphaned
        proc.wait(timeout=30)
        code, _, err = run(*args, "--train.max_steps=5")  # the requeue, at once
        assert code == 0, err[-3000:]
        assert "in use by" not in err
        assert train_steps(run_dir)[-1] == 5
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # any orphaned worker


def test_a_hook_in_the_working_directory_loads_with_the_installed_command(tmp_path, token_dirs):
    command = pathlib.Path(sys.executable).parent / "kempnerforge"
    assert command.is_file(), "the package's console script is not installed"
    hooks = '--train.hooks=["examples.loss_spike_alert:LossSpikeAlert"]'
    code, out, err = run(
        *tiny(tmp_path / "run", token_dirs, "--train.max_steps=2", hooks), command=str(command)
    )
    assert code == 0, err[-3000:]
    assert "finished at step 2" in out


def test_help_needs_no_torch_and_points_to_the_config_reference():
    probe = (
        "import sys; from kempnerforge.cli import _build_parser; _build_parser(); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('numpy')))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    code, out, _ = run("train", "--help")
    assert code == 0
    assert "docs/config.md" in out
    for section in ("[model]", "[train]", "[optimizer]", "[checkpoint]"):
        assert section in out


def test_a_full_disk_while_writing_metrics_is_one_line_naming_the_file(tmp_path, token_dirs):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / RUN_MARKER).touch()  # a run's directory, so its metrics.jsonl is the run's
    (run_dir / "metrics.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    code, _, err = run(*tiny(run_dir, token_dirs, "--train.max_steps=3"))
    assert code == 1
    assert one_line(err) == (
        f"kempnerforge: error: {run_dir / 'metrics.jsonl'}: No space left on device"
    )


@pytest.fixture
def full_disk(tmp_path):
    """A directory on a tiny tmpfs that is already full (needs the right to mount)."""
    mount = tmp_path / "full"
    mount.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if mounted.returncode != 0:
        no_small_disks(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        with open(mount / "filler", "wb") as f, contextlib.suppress(OSError):
            f.write(b"\0" * (1 << 20))
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_at_startup_is_one_line_naming_the_path(full_disk, token_dirs):
    run_dir = full_disk / "run"
    code, _, err = run(*tiny(run_dir, token_dirs, "--train.max_steps=2"))
    assert code == 1
    line = one_line(err)
    assert line.startswith(f"kempnerforge: error: {run_dir}")
    assert line.endswith(": No space left on device")
