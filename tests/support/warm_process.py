"""popen and run: `python -m kempnerforge ...` in a process of its own, forked from a server
that has already imported torch and the package, with subprocess's API.

A fresh interpreter spends about 3 s of CPU importing before a test's command does a few
hundred milliseconds of work; here each pytest process starts one server (warm_server.py)
and every command is a child forked from it: its own pid, its own session when asked, the
caller's directory, environment and standard streams (pipes readable while it runs), and
its real exit code (negative for a signal). It runs `python -m kempnerforge` through runpy,
so `kempnerforge.cli.main` sees the same sys.argv, sys.orig_argv and `__main__`, and ends
as that interpreter ends: non-daemon threads joined, atexit handlers run, streams flushed,
or at once where the command calls os._exit itself.

What differs from a fresh interpreter, and why it does not change what a test sees:
- Environment read at import. Nothing preloaded reads it then (warm_server.PRELOADED; the
  package reads it in functions only; Hugging Face's libraries, which read it at import,
  are not preloaded and the server refuses to start with them loaded). Variables that the
  interpreter, OpenMP, MKL, the loader or the locale read at start (PYTHON*, TORCH*,
  OMP_*, MKL_*, LD_*, LC_*, LANG, HOME, TZ, ...) send the command to a fresh interpreter
  whenever they differ from the server's (`needs_fresh_interpreter`), except two that the
  child applies itself: PYTHONPATH (sys.path rebuilt as `python -m` builds it) and
  OMP_NUM_THREADS (torch's intra-op threads set from it; the server runs without it, so it
  knows the default). TMPDIR is read afresh (tempfile's cache is cleared).
- Signals: the child restores the dispositions the server's interpreter started with,
  which are those of any interpreter this process starts, before it reports its pid; a
  signal sent at once therefore meets the defaults, as it would during a fresh start.
- Multiprocessing: the server never uses it, so the child's default start method, its
  forkserver and its resource tracker are unset as in a fresh interpreter; spawn children
  see a `__main__` of kempnerforge/__main__.py, as after `python -m`.
- Randomness: `random` reseeds itself in a forked child, numpy's global generator is
  reseeded by the child; torch's default seed is a constant anyway. String hashing keeps
  the server's seed in every child of one server, where fresh interpreters draw one each:
  set orders agree between the runs of one pytest process and still differ between
  pytest processes (and runs), so an order dependence still shows, less often.
- The parent pid is the server's, which reaps the child at once: no zombie lingers until
  the test waits. The child's stdin is the caller's (none given: this process's), as with
  subprocess; /proc/<pid>/cmdline shows the server's command line.
- The package (and tests.support) is the one the server imported from this checkout,
  where a fresh interpreter outside it would import the installed one: the same files
  wherever the package is installed in development mode, as the suite expects.
- Import-time objects are frozen out of the garbage collector (gc.freeze): they are never
  garbage, and it spares each child scanning and copying them.
- Import-time warnings were printed (once, to the server's stderr) when the server
  imported; every command imports after cli.main has set its warning filters anyway.
- Objects reachable only at interpreter teardown are not finalised: CPython gives no
  promise to finalise them either, and every command closes its files before it returns.

A command that re-executes itself (train and eval do, once, to preload tcmalloc where it
is installed) becomes a fresh interpreter from there on: the same pid and streams, only
the saving is lost. `KF_TEST_FRESH_PROCESSES=1` sends every command to a fresh
interpreter, to compare.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import locale
import os
import pathlib
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any

from tests.support.warm_server import HEADER, STATUS

REPO = pathlib.Path(__file__).parents[2]
KEMPNERFORGE = [sys.executable, "-m", "kempnerforge"]
WARM_MODULES = ("kempnerforge", "torch.distributed.run", "kempnerforge.launch.node_torchrun")
"""The modules a command may run (`python -m MODULE ...`) in a child of the warm server:
the command line, and the launchers that start its ranks (each rank a fresh interpreter
that the launcher starts, as ever; only the launcher's own imports are spared)."""
FRESH_ENV = "KF_TEST_FRESH_PROCESSES"
SERVE = "from tests.support.warm_server import serve"

APPLIED_BY_CHILD = ("OMP_NUM_THREADS", "PYTHONPATH")
READ_AT_START = (
    "PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "LD_",
    "MALLOC_", "LC_", "LANG", "HOME", "TZ", "CUDA", "NCCL_", "GLOO_", "KINETO", "DNNL_",
    # torch._dynamo's and inductor's configs and sympy's, read when they are imported
    "AOT", "INDUCTOR_", "CUTLASS_", "CUTEDSL_", "CXX", "CC", "SYMPY_", "MPMATH_", "SAGE_",
    "PARTITIONER_", "ENABLE_", "FAKE_", "LOG_", "DUMP_", "PT2_", "UNSAFE_", "CI", "USER",
    "LOGNAME", "LNAME",
)  # fmt: skip
"""Prefixes of variables read when an interpreter or torch starts (or when the server
preloads torch._dynamo): a command whose value differs from the server's runs in a fresh
interpreter (APPLIED_BY_CHILD excepted)."""

_SUPPORTED = {"cwd", "env", "stdin", "stdout", "stderr", "text", "universal_newlines",
              "encoding", "errors", "start_new_session", "bufsize"}  # fmt: skip


def popen(args: Sequence[str], **kwargs: Any) -> Process:
    """subprocess.Popen(args, **kwargs), forked from the warm server when ``args`` is
    `python -m MODULE ...` of a module in WARM_MODULES and nothing about the launch needs a
    fresh interpreter."""
    args = list(args)
    given_env = kwargs.get("env")
    env = dict(os.environ if given_env is None else given_env)
    if (
        args[:2] != KEMPNERFORGE[:2]
        or len(args) < 3
        or args[2] not in WARM_MODULES
        or set(kwargs) - _SUPPORTED
        or os.environ.get(FRESH_ENV) == "1"
        or needs_fresh_interpreter(env, _server().env)
    ):
        return subprocess.Popen(args, **kwargs)
    return WarmProcess(args, env, **{k: v for k, v in kwargs.items() if k != "env"})


def run(
    args: Sequence[str],
    *,
    input: str | bytes | None = None,
    capture_output: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kwargs: Any,
) -> subprocess.CompletedProcess:
    """subprocess.run with popen's process: on a timeout the command is killed, waited for
    and TimeoutExpired raised, as subprocess.run does."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        kwargs["stdin"] = subprocess.PIPE
    with popen(args, **kwargs) as process:
        try:
            out, err = process.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            raise
        code = process.wait()
    done = subprocess.CompletedProcess(process.args, code, out, err)
    if check:
        done.check_returncode()
    return done


def needs_fresh_interpreter(env: Mapping[str, str], server_env: Mapping[str, str]) -> bool:
    """Whether a variable read at start differs between ``env`` and the server's."""
    names = {n for n in set(env) | set(server_env) if env.get(n) != server_env.get(n)}
    return any(n.startswith(READ_AT_START) and n not in APPLIED_BY_CHILD for n in names)


class WarmProcess:
    """A command forked from the warm server, driven like subprocess.Popen: pid, args,
    returncode, stdin/stdout/stderr, poll, wait, communicate, send_signal, terminate, kill."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        *,
        cwd: str | os.PathLike[str] | None = None,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool | None = None,
        universal_newlines: bool | None = None,
        encoding: str | None = None,
        errors: str | None = None,
        start_new_session: bool = False,
        bufsize: int = -1,
    ) -> None:
        self.args = args
        self.returncode: int | None = None
        self._text = bool(text or universal_newlines or encoding or errors)
        self._encoding = encoding or locale.getpreferredencoding(False)
        self._errors = errors or "strict"
        self._pumps: list[threading.Thread] | None = None
        self._output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        self._communicated: tuple[Any, Any] | None = None
        ours, theirs = [], []  # descriptors this side keeps / hands over and closes
        child_in, self.stdin = self._stream(stdin, 0, "wb", bufsize, ours, theirs)
        child_out, self.stdout = self._stream(stdout, 1, "rb", bufsize, ours, theirs)
        if stderr == subprocess.STDOUT:
            child_err, self.stderr = child_out, None
        else:
            child_err, self.stderr = self._stream(stderr, 2, "rb", bufsize, ours, theirs)
        request = {
            "module": args[2],
            "args": args[3:],
            "cwd": os.path.abspath(os.getcwd() if cwd is None else cwd),
            "env": env,
            "new_session": start_new_session,
        }
        self._status, child_status = socket.socketpair()
        try:
            _server().send(request, [child_status.fileno(), child_in, child_out, child_err])
        finally:
            child_status.close()
            for fd in theirs:
                os.close(fd)
        tag, self.pid, code = self._read_status(None)
        if tag == b"X":  # the child failed before it was set up; its stderr says why
            self.returncode = code

    def _stream(
        self, spec: Any, default_fd: int, mode: str, bufsize: int, ours: list, theirs: list
    ) -> tuple[int, IO | None]:
        if spec is None:
            return default_fd, None
        if spec == subprocess.DEVNULL:
            fd = os.open(os.devnull, os.O_RDWR)
            theirs.append(fd)
            return fd, None
        if spec == subprocess.PIPE:
            read, write = os.pipe()
            mine, child = (write, read) if mode == "wb" else (read, write)
            theirs.append(child)
            stream: IO = open(mine, mode, bufsize)  # noqa: SIM115
            if self._text:
                stream = io.TextIOWrapper(
                    stream,  # type: ignore[arg-type]
                    encoding=self._encoding,
                    errors=self._errors,
                    write_through=mode == "wb",
                )
            return child, stream
        return (spec if isinstance(spec, int) else spec.fileno()), None

    def _read_status(self, timeout: float | None) -> tuple[bytes, int, int]:
        self._status.settimeout(timeout)
        data = b""
        try:
            while len(data) < STATUS.size:
                chunk = self._status.recv(STATUS.size - len(data))
                if not chunk:
                    raise RuntimeError(f"the warm server went away while {self.args} ran")
                data += chunk
        except TimeoutError:
            if data:  # never splits in practice: 17 bytes sent at once
                raise RuntimeError("a status message arrived in pieces") from None
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        return STATUS.unpack(data)

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self.wait()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            tag, _, code = self._read_status(timeout)
            assert tag == b"X", tag
            self.returncode = code
            self._status.close()
        return self.returncode

    def communicate(
        self, input: str | bytes | None = None, timeout: float | None = None
    ) -> tuple[Any, Any]:
        """Feed ``input``, read stdout and stderr to their end, wait; as Popen.communicate,
        a call after TimeoutExpired carries on where the first left off."""
        if self._communicated is not None:
            return self._communicated
        if self._pumps is None:
            self._pumps = self._start_pumps(input)
        deadline = None if timeout is None else time.monotonic() + timeout
        for pump in self._pumps:
            pump.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if pump.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        try:
            self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise subprocess.TimeoutExpired(self.args, timeout or 0) from None
        self._communicated = (self._collected("stdout"), self._collected("stderr"))
        return self._communicated

    def _start_pumps(self, input: str | bytes | None) -> list[threading.Thread]:
        pumps = []
        if self.stdin is not None:
            pumps.append(threading.Thread(target=self._feed, args=(input,), daemon=True))
        for name in ("stdout", "stderr"):
            stream = getattr(self, name)
            if stream is not None:
                drain = (stream.fileno(), self._output[name])
                pumps.append(threading.Thread(target=_drain, args=drain, daemon=True))
        for pump in pumps:
            pump.start()
        return pumps

    def _feed(self, input: str | bytes | None) -> None:
        assert self.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            if input:
                self.stdin.write(input)  # type: ignore[arg-type]
            self.stdin.close()

    def _collected(self, name: str) -> Any:
        stream = getattr(self, name)
        if stream is None:
            return None
        data = b"".join(self._output[name])
        stream.close()
        if not self._text:
            return data
        text = data.decode(self._encoding, self._errors)
        return text.replace("\r\n", "\n").replace("\r", "\n")

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)

    def __enter__(self) -> WarmProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for stream in (self.stdout, self.stderr, self.stdin):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        self.wait()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._status.close()


Process = WarmProcess | subprocess.Popen
"""What popen returns: either drives the same way."""


def _drain(fd: int, chunks: list[bytes]) -> None:
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)


class _Server:
    """This process's fork server: started at the first command, gone with this process."""

    def __init__(self) -> None:
        self.env = {k: v for k, v in os.environ.items() if k not in APPLIED_BY_CHILD}
        self.control, theirs = socket.socketpair()
        self.lock = threading.Lock()
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"{SERVE}; serve({theirs.fileno()})"],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.owner = os.getpid()
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (it leaves when its socket closes) and reap it, so that its CPU time
        and its children's count as this process's children's."""
        self.control.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)

    def send(self, request: dict[str, Any], fds: list[int]) -> None:
        payload = pickle.dumps(request)
        with self.lock:
            socket.send_fds(self.control, [HEADER.pack(len(payload))], fds)
            self.control.sendall(payload)


_current: _Server | None = None
_current_lock = threading.Lock()


def _server() -> _Server:
    """This process's server, started anew when none runs or when this process's own
    variables read at start have changed since it started (a test that left one set would
    otherwise send every later command to a fresh interpreter)."""
    global _current
    with _current_lock:
        if (
            _current is not None
            and _current.owner == os.getpid()
            and needs_fresh_interpreter(os.environ, _current.env)
        ):
            _current.close()
            _current = None
        if _current is None or _current.owner != os.getpid() or _current.process.poll() is not None:
            _current = _Server()
        return _current
