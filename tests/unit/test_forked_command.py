"""launch/forked_command.py: a `python -m MODULE ...` command run in a child forked from
this process returns what a fresh interpreter's run returns (exit code, stdout, stderr),
ends as that interpreter ends, and leaves this process's state alone.

A fork is taken only in a single-threaded process (a test worker runs threads of its own),
so the cases run in a driver process of their own, which imports torch as check-parallel
has by the time it runs anything, and reports each case's outcome as JSON."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from kempnerforge.launch.forked_command import forkable

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="forks only on Linux")

REPO = pathlib.Path(__file__).parents[2]

PROBES = {
    "forked_probe": """
import atexit, os, sys, threading, time
atexit.register(lambda: print("atexit ran", flush=True))
def late():
    time.sleep(0.2)
    print("thread joined", flush=True)
threading.Thread(target=late).start()
print("argv", sys.argv[1:], "main", __name__, flush=True)
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("CODE", "0")))
""",
    "killed_probe": "import os, signal\nprint('before', flush=True)\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n",
    "raising_probe": "raise RuntimeError('boom')\n",
    "quiet_probe": "import sys\nsys.argv.append('x')\n",
}

DRIVER = """
import json, os, sys, tempfile, threading
import torch  # noqa: F401  (check-parallel has imported it by the time it runs a command)
from kempnerforge.launch.forked_command import forkable, run_captured

def probe(name, *args):
    return [sys.executable, "-m", name, *args]

def done(result):
    return {"code": result.returncode, "out": result.stdout, "err": result.stderr}

cases = {}
command = probe("forked_probe", "--a", "b c")
cases["forkable"] = forkable(command)
for code in ("0", "3"):
    os.environ["CODE"] = code
    cases[f"forked_{code}"] = done(run_captured(command))
    cases[f"fresh_{code}"] = done(run_captured(command, fork=False))
os.environ["CODE"] = "0"
cases["killed"] = done(run_captured(probe("killed_probe")))
cases["raising"] = done(run_captured(probe("raising_probe")))
argv, cwd = list(sys.argv), os.getcwd()
with tempfile.TemporaryDirectory() as kept:
    cases["quiet"] = done(run_captured(probe("quiet_probe")))
    cases["kept"] = os.path.isdir(kept)
cases["state_kept"] = sys.argv == argv and os.getcwd() == cwd
stop = threading.Event()
helper = threading.Thread(target=stop.wait)
helper.start()
cases["forkable_with_a_thread"] = forkable(command)
cases["with_a_thread"] = done(run_captured(command))  # in a fresh interpreter
stop.set()
helper.join()
print(json.dumps(cases))
"""


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """The driver's outcome of each case (a module on PYTHONPATH per probe)."""
    root = tmp_path_factory.mktemp("probes")
    for name, text in PROBES.items():
        (root / f"{name}.py").write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}
    done = subprocess.run(
        [sys.executable, "-c", DRIVER], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.parametrize("code", [0, 3])
def test_a_forked_command_returns_what_a_fresh_interpreter_returns(cases, code):
    forked, fresh = cases[f"forked_{code}"], cases[f"fresh_{code}"]
    assert cases["forkable"]
    assert forked["code"] == fresh["code"] == code
    assert forked["out"] == fresh["out"]
    assert forked["out"].splitlines() == [
        "argv ['--a', 'b c'] main __main__",
        "thread joined",
        "atexit ran",
    ]
    assert forked["err"] == fresh["err"] == "to stderr\n"


def test_a_child_killed_by_a_signal_reports_it_as_subprocess_does(cases):
    assert cases["killed"]["code"] == -signal.SIGKILL and cases["killed"]["out"] == "before\n"


def test_an_uncaught_error_prints_its_traceback_and_exits_1(cases):
    raising = cases["raising"]
    assert raising["code"] == 1
    assert "Traceback" in raising["err"] and "RuntimeError: boom" in raising["err"]


def test_the_child_leaves_this_process_and_its_temporary_directory_alone(cases):
    """The child's exit calls none of this process's finalizers (a temporary directory's
    removal among them), and its argv and directory stay this process's."""
    assert cases["quiet"]["code"] == 0 and cases["kept"] and cases["state_kept"]


def test_what_cannot_fork_safely_runs_in_a_fresh_interpreter(cases):
    """Another interpreter's command, a command that is no `-m`, or a second thread running
    here: each goes to subprocess, and still runs."""
    assert not forkable(["/usr/bin/env", "-m", "forked_probe"])
    assert not forkable([sys.executable, "-c", "pass"])
    assert not cases["forkable_with_a_thread"]
    with_a_thread = cases["with_a_thread"]
    assert with_a_thread["code"] == 0 and with_a_thread["err"] == "to stderr\n"
