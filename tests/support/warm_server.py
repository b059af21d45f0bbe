"""The fork server behind tests.support.warm_process: a process that has imported torch and
the package once, and forks one child per `python -m MODULE` command a test starts (the
command line, or torchrun's launcher: warm_process.WARM_MODULES).

Started by warm_process as `python -c "...serve(fd)"` with one end of a socket pair. Each
request on that socket carries the command's module and arguments, working directory,
environment and whether it leads a new session, plus four descriptors: a status socket for
this command and the stdin, stdout and stderr the child is to have. On the status socket
the child says ("P", pid) once it is set up, and the server says ("X", pid, exit code) when
it has reaped it. The server forks from its own state only, never from a child, so no
command sees what another did; it ends when the socket pair's other end closes.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import pickle
import selectors
import signal
import socket
import struct
import sys
import tempfile
import traceback
from typing import Any, NoReturn

from kempnerforge.launch.forked_command import run_module_as_main

HEADER = struct.Struct("!Q")
"""Length of the pickled request that follows; the descriptors ride on these bytes."""

STATUS = struct.Struct("!cqq")
"""A status message: b"P" (set up, pid) or b"X" (exited, pid, code as subprocess reports
it: negative for a signal)."""

PRELOADED = [
    "torch",
    "torch._dynamo",  # imported by every optimizer's first add_param_group: 0.8 s of CPU
    "kempnerforge.cli",
    "kempnerforge.commands.train",
    "kempnerforge.commands.eval",
    "kempnerforge.commands.generate",
    "kempnerforge.commands.prepare_data",
    "kempnerforge.commands.hf",
    "kempnerforge.training.build",
    "kempnerforge.training.loop",
    "kempnerforge.training.session",
    "kempnerforge.training.inference.eval_checkpoint",
    "kempnerforge.checkpoint.manager",
    "kempnerforge.data.pipeline_build",
    "torch.distributed.run",
    "kempnerforge.launch.node_torchrun",
]
"""What a training or evaluation command, or a torchrun launcher, imports (about 3 s of CPU
in a fresh interpreter).
None of it reads the environment at import; the libraries that do (Hugging Face's, read
for their cache and offline switches) are left for the child to import after its
environment is in place."""

NOT_PRELOADED = ("huggingface_hub", "transformers", "datasets", "tokenizers", "lm_eval")
"""Read the environment when imported: the server refuses to start with one of them loaded."""


def serve(control_fd: int) -> NoReturn:
    """Preload, then fork a child for each request on ``control_fd`` until it closes."""
    # Taken before any import: the dispositions this interpreter started with are the ones
    # a fresh interpreter started the same way would have, and every child gets them back.
    fixed = (signal.SIGKILL, signal.SIGSTOP)
    dispositions = {s: signal.getsignal(s) for s in signal.valid_signals() if s not in fixed}
    control = socket.socket(fileno=control_fd)
    for name in PRELOADED:
        importlib.import_module(name)
    loaded = sorted(m for m in NOT_PRELOADED if m in sys.modules)
    if loaded:
        raise RuntimeError(f"preloading imported {loaded}, which read the environment at import")
    import torch

    # The intra-op thread count a fresh interpreter takes when OMP_NUM_THREADS is unset
    # (the server is started without it).
    default_threads = torch.get_num_threads()
    base_path = sys.path[1:]  # sys.path[0] is the working directory's entry
    # Import-time objects never become garbage: keeping them out of the collector's
    # generations spares every child from scanning them (and from copying their pages).
    gc.collect()
    gc.freeze()
    selector = selectors.DefaultSelector()
    selector.register(control, selectors.EVENT_READ)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, status socket)
    while True:
        for key, _ in selector.select():
            if key.fileobj is control:
                received = _receive(control)
                if received is None:
                    # The test process is gone; running children finish on their own. No
                    # finalisation: there is nothing to flush, and torch's takes a while.
                    os._exit(0)
                request, fds = received
                pid = os.fork()
                if pid == 0:
                    os._exit(
                        _child(
                            request,
                            fds,
                            [control.fileno(), selector],
                            children,
                            dispositions,
                            base_path,
                            default_threads,
                        )
                    )
                for fd in fds[1:]:
                    os.close(fd)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = (pid, socket.socket(fileno=fds[0]))
                selector.register(pidfd, selectors.EVENT_READ)
            else:
                pidfd = key.fd
                pid, status = children.pop(pidfd)
                selector.unregister(pidfd)
                os.close(pidfd)
                _, raw = os.waitpid(pid, 0)
                with contextlib.suppress(OSError):  # the test stopped listening
                    status.sendall(STATUS.pack(b"X", pid, os.waitstatus_to_exitcode(raw)))
                status.close()


def _receive(control: socket.socket) -> tuple[dict[str, Any], list[int]] | None:
    header, fds, _, _ = socket.recv_fds(control, HEADER.size, 4)
    if not header:
        return None
    while len(header) < HEADER.size:
        header += _exactly(control, HEADER.size - len(header))
    (size,) = HEADER.unpack(header)
    return pickle.loads(_exactly(control, size)), fds


def _exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise EOFError("the test process closed the request socket mid-request")
        data += chunk
    return data


def _child(
    request: dict[str, Any],
    fds: list[int],
    server_fds: list[Any],
    children: dict[int, tuple[int, socket.socket]],
    dispositions: dict[signal.Signals, Any],
    base_path: list[str],
    default_threads: int,
) -> int:
    """Become the command: the server's descriptors closed, the request's stdio, session,
    signal dispositions, directory, environment, path and thread count in place; then run
    it as `python -m kempnerforge` and end as that interpreter would. Returns the exit code."""
    try:
        status = socket.socket(fileno=fds[0])
        os.close(server_fds[0])
        server_fds[1].close()
        for pidfd, (_, other) in children.items():
            os.close(pidfd)
            other.close()
        if request["new_session"]:
            os.setsid()
        for source, target in zip(fds[1:], (0, 1, 2), strict=True):
            os.dup2(source, target)
        for source in set(fds[1:]) - {0, 1, 2}:
            os.close(source)
        for signum, handler in dispositions.items():
            with contextlib.suppress(OSError, ValueError):
                signal.signal(signum, handler)
        sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        _set_path(request["cwd"], base_path)
        tempfile.tempdir = None  # TMPDIR is read at the first use, as in a fresh process
        _set_threads(default_threads)
        if "numpy.random" in sys.modules:
            sys.modules["numpy.random"].seed()  # else every child draws the server's numbers
        sys.argv = ["-m", *request["args"]]  # runpy puts the module's path in sys.argv[0]
        sys.orig_argv = [sys.executable, "-m", request["module"], *request["args"]]
        status.sendall(STATUS.pack(b"P", os.getpid(), 0))
        status.close()
    except BaseException:
        traceback.print_exc()
        return 70
    return run_module_as_main(request["module"])


def _set_path(cwd: str, base_path: list[str]) -> None:
    """sys.path as `python -m` in ``cwd`` builds it: the directory, PYTHONPATH, the rest."""
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    path: list[str] = []
    for entry in [cwd, *extra, *base_path]:
        if entry not in path:
            path.append(entry)
    sys.path[:] = path


def _set_threads(default_threads: int) -> None:
    """torch's intra-op threads from OMP_NUM_THREADS, which OpenMP read when torch loaded in
    the server: its first number when it is a positive integer, else the default."""
    import torch

    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    torch.set_num_threads(int(first) if first.isdigit() and int(first) > 0 else default_threads)
