"""run_distributed: run a function on real gloo ranks, each in a process of its own."""

from __future__ import annotations

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120.0
"""Whole-job limit: a hung collective fails the test instead of stalling the suite."""

PRELOADED = ["torch", "torch._dynamo", "kempnerforge.training.build", "tests.support.train_run"]
"""Imported once by the fork server the ranks are forked from, instead of by every rank:
about 2 s of CPU per rank otherwise, most of a small distributed test's time."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int = 2,
    *args: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank of a gloo group; return the results.

    ``fn`` and ``args`` must pickle (a module-level function): each rank is a fresh process
    (forked from a server that has PRELOADED imported) with this process's environment and
    one intra-op thread, joined through a ``file://`` store in a temporary directory, so
    concurrent tests never share a port. ``fn``'s return values come back indexed by rank.
    A rank that raises fails the call with that rank's traceback (the others are
    terminated); a job still running after ``timeout_s`` is killed and raises TimeoutError.
    """
    workdir = tempfile.mkdtemp(prefix="kf-dist-")
    try:
        multiprocessing.set_forkserver_preload(PRELOADED)  # no effect once the server runs
        context = mp.start_processes(
            _worker,
            args=(world_size, workdir, fn, args, timeout_s, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method="forkserver",
        )
        deadline = time.monotonic() + timeout_s
        while not _joined(context, workdir):  # raises ProcessRaisedException on a failure
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.kill()
                for process in context.processes:
                    process.join(timeout=10)
                raise TimeoutError(
                    f"{getattr(fn, '__name__', fn)} did not finish on {world_size} ranks "
                    f"within {timeout_s:.0f} s (a rank is stuck in a collective?)"
                )
        results = []
        for rank in range(world_size):
            with open(os.path.join(workdir, f"result_{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
        return results
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _joined(context: Any, workdir: str) -> bool:
    """context.join(0.2), but a rank killed by a signal (a crash in a native library such as
    gloo) fails with the Python stacks of its threads at that moment, which faulthandler
    wrote into the rank's crash file, instead of the bare signal name."""
    try:
        return context.join(timeout=0.2)
    except mp.ProcessExitedException as exc:
        stacks = _crash_report(workdir, exc.error_index)
        if not stacks:
            raise
        raise RuntimeError(f"{exc}\nits threads when it died:\n{stacks}") from exc


def _crash_report(workdir: str, rank: int) -> str:
    try:
        with open(os.path.join(workdir, f"crash_{rank}.txt")) as f:
            return f.read().strip()
    except OSError:
        return ""


def _worker(
    rank: int,
    world_size: int,
    workdir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    timeout_s: float,
    environ: dict[str, str],
) -> None:
    # A fatal signal (SIGSEGV, SIGABRT, SIGBUS) writes every thread's stack where the caller
    # reads it (_crash_report); the file stays open for the process's life.
    crash_file = open(os.path.join(workdir, f"crash_{rank}.txt"), "w")  # noqa: SIM115
    faulthandler.enable(crash_file, all_threads=True)
    # The fork server's environment is that of the first call: take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    torch.set_num_threads(1)  # OMP_NUM_THREADS may be unset; the cores are shared
    # What torchrun sets, so code that reads the launch from the environment sees it.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(workdir, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        # Every rank done before any leaves: a rank that closes its connections while a
        # peer's last collectives are still in flight fails that peer.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(workdir, f"result_{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Leave without interpreter finalisation. A gloo worker thread can still be dropping
    # the last reference to a finished collective (whose tensors are Python-owned) after
    # the barrier returned; if that happens while Python finalises, the thread is forced
    # out of the GIL inside a noexcept destructor and the rank dies of SIGABRT although
    # its work is done and its result written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
