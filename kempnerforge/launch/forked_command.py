"""check-parallel's `python -m MODULE ...` commands (the single-process reference, a torchrun
launcher) run in a child forked from check-parallel's own process, its output captured.

check-parallel has imported torch by the time it runs anything (the launch checks load it),
and a fresh interpreter for the reference or for a torchrun launcher would spend 2 to 3 s
of CPU importing it again before a few steps of a small model: most of what a check of
one layout costs on a CPU. A child forked after those imports starts at once and runs the
module as `python -m` runs it (runpy, ``__main__``, the command's argv), with the same
environment, directory and signal dispositions, and ends as that interpreter ends: its
non-daemon threads joined, atexit handlers run, streams flushed, its exit code (negative
for a signal) reported as subprocess reports it. What the child runs is still a process of
its own: the reference's globals (seeds, deterministic mode, logging) and the launcher's
signal handlers never reach check-parallel. torchrun's ranks are fresh interpreters either
way.

A fork is only taken where it is safe and gains something: on Linux, with torch imported,
and with this process single-threaded (a thread holding a lock at the fork would leave it
held in the child). Anything else, and `check-parallel --fresh-processes`, starts a fresh
interpreter through subprocess.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import weakref
from collections.abc import Sequence


def run_captured(command: Sequence[str], *, fork: bool = True) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True), forked from this process
    when ``fork`` and `command` is `python -m MODULE ...` of this interpreter and a fork is
    safe here (see the module's docstring)."""
    command = list(command)
    if not (fork and forkable(command)):
        return subprocess.run(command, capture_output=True, text=True, check=False)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        for stream in (sys.stdout, sys.stderr):  # else the child writes our buffer again
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns from here
            _become(command, out.fileno(), err.fileno())
        try:
            _, status = os.waitpid(pid, 0)
        except BaseException:  # interrupted while waiting: as subprocess.run does
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        return subprocess.CompletedProcess(
            command, os.waitstatus_to_exitcode(status), _text(out), _text(err)
        )


def forkable(command: Sequence[str]) -> bool:
    """Whether ``command`` may run in a forked child of this process."""
    return (
        len(command) >= 3
        and command[0] == sys.executable
        and command[1] == "-m"
        and sys.platform == "linux"
        and "torch" in sys.modules
        and threading.active_count() == 1
    )


def _text(stream) -> str:
    stream.seek(0)
    return stream.read().decode("utf-8", errors="replace")


def _become(command: list[str], out_fd: int, err_fd: int) -> None:
    """In the forked child: the captured streams in place of stdout and stderr, then the
    module run as `python -m` runs it; leaves the process with the command's exit code."""
    code = 70  # the child could not be set up (the traceback says why)
    try:
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        _fresh_standard_streams()
        _leave_finalizers_to_the_parent()
        if "numpy.random" in sys.modules:  # else the child draws this process's numbers
            sys.modules["numpy.random"].seed()
        tempfile.tempdir = None  # TMPDIR read afresh, as at a fresh start
        sys.argv = ["-m", *command[3:]]  # runpy puts the module's path in sys.argv[0]
        sys.orig_argv = list(command)
        code = run_module_as_main(command[2])
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _fresh_standard_streams() -> None:
    """sys.stdout and sys.stderr on descriptors 1 and 2, as a fresh interpreter has them
    (this process's may be someone's replacement that writes elsewhere)."""
    encoding = getattr(sys.__stdout__, "encoding", None) or "utf-8"
    sys.stdout = open(1, "w", encoding=encoding, closefd=False)  # noqa: SIM115
    sys.stderr = open(  # noqa: SIM115
        2, "w", encoding=encoding, errors="backslashreplace", closefd=False, buffering=1
    )  # line-buffered, as every interpreter's stderr since Python 3.9


def _leave_finalizers_to_the_parent() -> None:
    """The finalizers this process holds (a temporary directory of check-parallel's runs,
    say) are its own to call at its exit: the child's exit must not call them too, so each
    inherited one is kept from running at exit (weakref.finalize's documented atexit
    flag). The command's own, made after the fork, still run."""
    for obj in gc.get_objects():
        # type(), not isinstance(): the latter also asks some objects for __class__, which
        # a deprecated torch attribute answers with a warning.
        if issubclass(type(obj), weakref.finalize):
            obj.atexit = False


def run_module_as_main(module: str) -> int:
    """Run ``module`` as `python -m` runs it (runpy, as ``__main__``, with this process's
    sys.argv) and finalise as the interpreter does at exit: join the non-daemon threads,
    run the atexit handlers, flush the standard streams. Returns the exit code; an uncaught
    KeyboardInterrupt ends the process by SIGINT, as it ends a fresh interpreter. For a
    process forked to become the command, which then leaves with os._exit(code)."""
    interrupted = False
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        code, interrupted = 1, True
    except BaseException as error:
        sys.excepthook(type(error), error, error.__traceback__)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def _exit_code(code: object) -> int:
    """The process exit code of SystemExit(code), as the interpreter computes it."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
