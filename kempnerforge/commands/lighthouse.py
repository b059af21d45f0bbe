"""`kempnerforge lighthouse`: the torchft lighthouse that forms each step's quorum of the
job's replica groups ([fault_tolerance], docs/fault-tolerance.md).

Building the parser imports no torch; the run imports torchft.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import math
import os
import signal
import socket
import statistics
import threading
from typing import Any

from kempnerforge.core.errors import ConfigError
from kempnerforge.core.metrics_file import read_tail_rows

JOIN_TIMEOUT_STEPS = 3.0
"""--join-timeout-from sets the join timeout to this many median step times (at least
--join-timeout-ms). The groups leave a step's commit together; what parts them before the
next quorum is their own work in between (optimizer step, logging, hooks) and the
machine's noise, each under a step's time: three step times wait out a group that is alive
with room to spare, and only a group that heartbeats but never joins costs that wait
(docs/fault-tolerance.md, Replica groups)."""
RECENT_ROWS = 100
"""Training rows per group that --join-timeout-from reads, the newest."""


def add_lighthouse_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge lighthouse`."""
    parser.add_argument(
        "--port", type=int, default=29510, help="TCP port to serve on (default 29510; 0: any)"
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="fewest replica groups a quorum may have (fault_tolerance.min_replica_groups)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=1000,
        help="how long a quorum waits for groups still joining before it forms without them",
    )
    parser.add_argument(
        "--join-timeout-from",
        metavar="RUN_DIR",
        default="",
        help=f"a replica groups' run directory: raise the join timeout to "
        f"{JOIN_TIMEOUT_STEPS:g} x the median step time its groups logged (their newest "
        f"{RECENT_ROWS} rows each); --join-timeout-ms stays the least",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a group silent this long is dead and left out of the next quorum",
    )


def run_lighthouse(args: argparse.Namespace, overrides: list[str]) -> int:
    """Serve the lighthouse until SIGTERM or SIGINT; print its address first; 0."""
    if overrides:
        raise ConfigError("<override>", " ".join(overrides), "none: the lighthouse has no config")
    for name in ("port", "min_replicas", "join_timeout_ms", "heartbeat_timeout_ms"):
        value = getattr(args, name)
        low = 1 if name == "min_replicas" else 0
        if value < low or (name == "port" and value > 65535):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(
                flag, value, f"an integer >= {low}" + (" and <= 65535" * (name == "port"))
            )
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "torchft",
            None,
            "the installed package (the lighthouse is torchft's)",
            "install the ft extra: pip install 'kempnerforge[ft]'",
        )
    why = "--join-timeout-ms; no --join-timeout-from run directory"
    if args.join_timeout_from:
        args.join_timeout_ms, why = join_timeout_from_run(
            args.join_timeout_from, args.join_timeout_ms
        )
    print(f"lighthouse: join timeout {args.join_timeout_ms} ms ({why})", flush=True)
    server = _start_server(args)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    port = server.address().rsplit(":", 1)[-1]
    print(f"lighthouse: http://{socket.gethostname()}:{port}", flush=True)
    print(f"export TORCHFT_LIGHTHOUSE=http://{socket.gethostname()}:{port}", flush=True)
    stop.wait()
    server.shutdown()
    return 0


def join_timeout_from_run(run_dir: str, least_ms: int) -> tuple[int, str]:
    """The join timeout for a job of replica groups whose run directory is ``run_dir``:
    JOIN_TIMEOUT_STEPS x the median ``step_time_s`` of its groups' newest training rows
    (``<run_dir>/replica_*/metrics.jsonl``), at least ``least_ms``; and why, in words.
    A run with no rows yet (its first start) gets ``least_ms``."""
    times: list[float] = []
    for path in sorted(glob.glob(os.path.join(run_dir, "replica_*", "metrics.jsonl"))):
        rows = read_tail_rows(path, RECENT_ROWS, _is_timed_step)
        times += [float(r["step_time_s"]) for r in rows if r["step_time_s"]]
    if not times:
        return least_ms, f"no step times in {run_dir} yet: --join-timeout-ms"
    median_s = statistics.median(times)
    chosen = max(least_ms, math.ceil(JOIN_TIMEOUT_STEPS * median_s * 1000))
    return chosen, (
        f"{JOIN_TIMEOUT_STEPS:g} x the median step time {median_s:.3f} s of {len(times)} "
        f"rows in {run_dir}, at least --join-timeout-ms = {least_ms}"
    )


def _is_timed_step(row: dict[str, Any]) -> bool:
    return "event" not in row and "step_time_s" in row


def _start_server(args: argparse.Namespace) -> Any:
    """torchft's LighthouseServer on ``args.port``; a port another process holds is the
    user's to change, so it is a ConfigError naming --port, not a traceback."""
    from torchft.coordination import LighthouseServer

    try:
        return LighthouseServer(
            bind=f"[::]:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except RuntimeError as error:
        # torchft's Rust server reports a failed bind as a RuntimeError carrying the OS text.
        if "address already in use" not in str(error).lower():
            raise
        raise ConfigError(
            "--port",
            args.port,
            "a port no other process listens on",
            "it is in use, perhaps by another lighthouse: pick another --port, "
            "or --port=0 for any free one",
        ) from error
