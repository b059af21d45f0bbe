"""RunLock: one run per directory, a clear error naming the holder, stale files taken over."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from kempnerforge.resilience.run_lock import RunLock, RunLockError

# A second process that holds the lock until its stdin closes.
HOLDER = textwrap.dedent(
    """
    import sys
    from kempnerforge.resilience.run_lock import RunLock
    with RunLock(sys.argv[1]):
        print("held", flush=True)
        sys.stdin.read()
    print("released", flush=True)
    """
)


@pytest.fixture
def holder(tmp_path):
    """A child process holding tmp_path/run's lock; closing its stdin releases it."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "run")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_process_cannot_take_a_held_run_dir(tmp_path, holder):
    run_dir = tmp_path / "run"
    with pytest.raises(RunLockError) as info:
        RunLock(run_dir).acquire()
    message = str(info.value)
    assert message.startswith(
        f"run directory {run_dir} is in use by pid {holder.pid} on {socket.gethostname()} (started "
    )
    assert message.endswith("); stop that run or choose another train.run_dir")
    assert info.value.holder is not None and info.value.holder["pid"] == holder.pid


def test_release_lets_another_process_acquire(tmp_path, holder):
    run_dir = tmp_path / "run"
    out, _ = holder.communicate(timeout=30)  # closes stdin: the holder releases and exits
    assert out.strip() == "released"
    with RunLock(run_dir) as lock:
        assert lock.held
        record = json.loads(lock.path.read_text())
    assert record["pid"] != holder.pid
    assert not lock.held
    assert lock.path.read_text() == ""  # a clean release leaves no stale record


def test_two_locks_in_one_process_also_exclude_each_other(tmp_path):
    with RunLock(tmp_path), pytest.raises(RunLockError, match="is in use by pid"):
        RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released by the block above
        pass


def test_a_lock_file_left_by_a_dead_process_is_taken_over_with_a_warning(tmp_path, log):
    dead = _dead_pid()
    stale = {"pid": dead, "host": socket.gethostname(), "started": "2000-01-01T00:00:00+00:00"}
    (tmp_path / ".lock").write_text(json.dumps(stale) + "\n")
    with RunLock(tmp_path) as lock:
        record = json.loads(lock.path.read_text())
    assert record["pid"] != dead and record["host"] == socket.gethostname()
    warnings = [r.getMessage() for r in log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"left by pid {dead} on {socket.gethostname()}" in warnings[0]
    assert "that process has exited" in warnings[0]


def test_acquire_creates_the_run_dir_and_is_idempotent(tmp_path, log):
    run_dir = tmp_path / "new" / "run"
    lock = RunLock(run_dir)
    lock.acquire()
    lock.acquire()
    assert (run_dir / ".lock").is_file() and lock.held
    lock.release()
    lock.release()
    assert not lock.held
    assert not log.records  # an empty lock file is not stale: no warning


# A process that takes the lock, forks a child the way a dataloader worker is forked (and
# that outlives it), then waits to be killed.
FORKING_HOLDER = textwrap.dedent(
    """
    import multiprocessing, sys, time
    from kempnerforge.resilience.run_lock import RunLock

    def worker(ready):
        ready.set()  # the fork handlers have run by now
        time.sleep(120)

    lock = RunLock(sys.argv[1])
    lock.acquire()
    context = multiprocessing.get_context("fork")
    ready = context.Event()
    child = context.Process(target=worker, args=(ready,), daemon=False)
    child.start()
    ready.wait(60)
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


def test_the_lock_dies_with_its_process_not_with_its_forked_children(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", FORKING_HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        proc.kill()  # SIGKILL: no cleanup runs in the holder, its child lives on
        proc.wait(timeout=30)
        with RunLock(run_dir) as lock:  # at once, while the orphan still runs
            assert lock.held
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
