"""launch/forked_command.py: a `python -m MODULE ...` command run in a child forked from
this process returns what a fresh interpreter's run returns (exit code, stdout, stderr),
ends as that interpreter ends, and leaves this process's state alone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading

import pytest

from kempnerforge.launch.forked_command import forkable, run_captured

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forks only on Linux")

SCRIPT = """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.2)
    print("thread joined", flush=True)
threading.Thread(target=late).start()
print("argv", sys.argv[1:], "main", __name__, flush=True)
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    """A module on sys.path (and PYTHONPATH, for a fresh interpreter) that prints its argv,
    writes to stderr, starts a non-daemon thread, registers an atexit handler and exits
    with $CODE."""
    (tmp_path / "forked_probe.py").write_text(SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return [sys.executable, "-m", "forked_probe", "--a", "b c"]


@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_command_returns_what_a_fresh_interpreter_returns(module, monkeypatch, code):
    monkeypatch.setenv("CODE", str(code))
    assert forkable(module)
    forked = run_captured(module)
    fresh = run_captured(module, fork=False)
    assert forked.returncode == fresh.returncode == code
    assert forked.stdout == fresh.stdout
    assert forked.stdout.splitlines() == [
        "argv ['--a', 'b c'] main __main__",
        "thread joined",
        "atexit ran",
    ]
    assert forked.stderr == fresh.stderr == "to stderr\n"


def test_a_child_killed_by_a_signal_reports_it_as_subprocess_does(tmp_path, monkeypatch):
    (tmp_path / "killed_probe.py").write_text(
        "import os, signal\nprint('before', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    done = run_captured([sys.executable, "-m", "killed_probe"])
    assert done.returncode == -signal.SIGKILL and done.stdout == "before\n"


def test_an_uncaught_error_prints_its_traceback_and_exits_1(tmp_path, monkeypatch):
    (tmp_path / "raising_probe.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    done = run_captured([sys.executable, "-m", "raising_probe"])
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "RuntimeError: boom" in done.stderr


def test_the_child_leaves_this_process_and_its_temporary_directory_alone(tmp_path, monkeypatch):
    """The child's exit calls none of this process's finalizers (a temporary directory's
    removal among them), and its argv, directory and buffered output stay this process's."""
    (tmp_path / "quiet_probe.py").write_text("import sys\nsys.argv.append('x')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    argv, cwd = list(sys.argv), os.getcwd()
    with tempfile.TemporaryDirectory() as kept:
        done = run_captured([sys.executable, "-m", "quiet_probe"])
        assert done.returncode == 0 and os.path.isdir(kept)
    assert sys.argv == argv and os.getcwd() == cwd


def test_what_cannot_fork_safely_runs_in_a_fresh_interpreter(module):
    """Another interpreter's command, a command that is no `-m`, or a second thread running
    here: each goes to subprocess."""
    assert not forkable(["/usr/bin/env", "-m", "forked_probe"])
    assert not forkable([sys.executable, "-c", "pass"])
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait)
    helper.start()
    try:
        assert not forkable(module)
        done = run_captured(module)  # still runs, in a fresh interpreter
        assert done.returncode == 0 and done.stderr == "to stderr\n"
    finally:
        stop.set()
        helper.join()
    assert isinstance(run_captured([sys.executable, "-c", "pass"]), subprocess.CompletedProcess)
