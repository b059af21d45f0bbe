"""Turn a failed collective into one line that names the collective and the rank.

A peer that dies breaks its connections at once; one that hangs (stopped, deadlocked,
stuck in I/O) is noticed when distributed.timeout_s runs out. Either way the backend's
own message names neither the operation nor the peer, so the surviving ranks work both
out: the operation from the traceback, the unresponsive ranks from a monitored barrier on
the runtime's side group (a gloo group over the world beside the default one).
"""

from __future__ import annotations

import datetime
import os
import re
import traceback

import torch.distributed as dist

from kempnerforge.distributed.runtime import RuntimeContext

_BACKEND_MARKERS = (
    "gloo",
    "NCCL",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "Socket Timeout",
)
_C10D_FILE = os.path.join("torch", "distributed", "distributed_c10d.py")
_OUR_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MONITOR_TIMEOUT_S = 30.0
"""Longest wait for the peers to answer the barrier that finds the unresponsive ones."""


def is_collective_failure(error: BaseException) -> bool:
    """True for an error raised by a process-group backend (a lost or hung peer)."""
    if isinstance(error, dist.DistError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _BACKEND_MARKERS)


def failed_collective(error: BaseException) -> str:
    """'all_reduce (called from kempnerforge/training/accumulate.py, finish_step)', read
    from the traceback; 'a collective' when it holds none."""
    frames = traceback.extract_tb(error.__traceback__)
    operation, caller = None, None
    for frame in frames:
        if frame.filename.endswith(_C10D_FILE) and operation is None:
            operation = frame.name
        elif frame.filename.startswith(_OUR_PACKAGE) and operation is None:
            relative = os.path.relpath(frame.filename, os.path.dirname(_OUR_PACKAGE))
            caller = f"{relative}, {frame.name}"
    if operation is None:
        return "a collective"
    return f"{operation} (called from {caller})" if caller else operation


def unresponsive_ranks(runtime: RuntimeContext, timeout_s: float) -> str:
    """Which peers fail to answer a monitored barrier on the side group, in words."""
    group = runtime.side_group
    if group is None:
        return "the peers could not be asked"
    try:
        dist.monitored_barrier(
            group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True
        )
    except RuntimeError as e:
        text = str(e)
        named = re.search(r"Ranks? ([\d, ]+) failed to pass", text)
        if named:
            return f"rank(s) {named.group(1).strip()} did not respond within {timeout_s:g} s"
        if "Connection closed" in text or "Connection reset" in text:
            return "a peer process has exited (its connection closed)"
        return f"the peers could not be asked ({text.splitlines()[0][:120]})"
    return "every peer answered afterwards (a transient network failure?)"


def describe_collective_failure(
    error: BaseException, runtime: RuntimeContext, timeout_s: float
) -> str:
    """One line for a failed collective: what, on which rank, and who did not answer."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    first_line = re.sub(r"^\[[^\]]*\.(cc|cpp):\d+\] ", "", first_line)[:200]
    peers = unresponsive_ranks(runtime, min(timeout_s, MONITOR_TIMEOUT_S))
    return (
        f"rank {runtime.rank}: {failed_collective(error)} failed: {first_line}; {peers} "
        f"(distributed.timeout_s = {timeout_s:g}); see that rank's log"
    )
