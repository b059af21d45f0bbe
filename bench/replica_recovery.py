"""Recovery times of replica groups against a whole-job restart, on CPU.

Two replica groups of one process train the tiny model (`kempnerforge train` subprocesses
and a `kempnerforge lighthouse`, on free ports). Measured from the groups' own
`replica_step` events (their wall-clock `time`):

- survivor: SIGKILL one group, then the time until the other commits a step without it;
- rejoin: relaunch the killed group, then the time until it commits its first step
  (process start, build, the quorum and the live state taken from its peer);
- restart: SIGKILL both groups, relaunch both, then the time until the first step is
  committed (process start, build and the load of the newest checkpoint from disk), and
  until the job is past the step it had reached (the steps since that checkpoint redone).

Prints one JSON line with the times, and rejoin's and survivor's ratios to restart.
Usage: python bench/replica_recovery.py --workdir /tmp/replica-bench
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

from kempnerforge.core.metrics_file import METRICS_FILE, iter_rows

REPO = pathlib.Path(__file__).parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _events(run_dir: pathlib.Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    if not path.exists():
        return []
    return [row for row in iter_rows(path) if row.get("event") == "replica_step"]


def _first_commit_after(
    run_dir: pathlib.Path,
    after: float,
    past_step: int = -1,
    alone: bool = False,
    limit_s: float = 300,
) -> float:
    """When ``run_dir`` first committed a step after time ``after`` (and, given
    ``past_step``, a step after that one; with ``alone``, one without the other group)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        events = [e for e in _events(run_dir) if e["time"] > after and e["step"] > past_step]
        times = [e["time"] for e in events if not alone or e["participants"] == 1]
        if times:
            return min(times)
        time.sleep(0.02)
    raise TimeoutError(f"{run_dir}: no step committed within {limit_s} s")


def _data_dir(workdir: pathlib.Path) -> str:
    import numpy as np

    from kempnerforge.data.tokenizer import ByteTokenizer
    from kempnerforge.data.tokens.token_file import TokenFileWriter

    path = workdir / "tokens"
    if not (path / "meta.json").exists():
        rng = np.random.default_rng(0)
        with TokenFileWriter(str(path), ByteTokenizer()) as writer:
            for _ in range(2000):
                writer.add_document(rng.integers(1, 250, size=int(rng.integers(20, 200))))
            writer.finish(num_sources=1)
    return str(path)


def _group(g: int, args: list[str], log: pathlib.Path) -> subprocess.Popen:
    env = {**os.environ, "KEMPNERFORGE_REPLICA_GROUP": str(g), "OMP_NUM_THREADS": "1"}
    with open(log, "a") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "kempnerforge", "train", *args],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=5000)
    args = parser.parse_args()
    work = pathlib.Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    job = work / f"job-{int(time.time())}"
    port = _free_port()
    lighthouse = subprocess.Popen(
        [sys.executable, "-m", "kempnerforge", "lighthouse", f"--port={port}",
         "--join-timeout-ms=200", "--heartbeat-timeout-ms=1000"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    train = [
        str(REPO / "configs" / "train" / "debug.toml"),
        "--model.dim=32", "--model.n_layers=2", "--model.n_heads=2", "--model.n_kv_heads=2",
        "--model.multiple_of=16", "--model.max_seq_len=64", "--train.batch_size=4",
        "--train.seq_len=32", "--train.sample_tokens=0", "--eval.interval=0",
        "--metrics.progress=off", f"--train.max_steps={args.steps}",
        "--checkpoint.interval=100", f"--train.run_dir={job}", f"--data.path={_data_dir(work)}",
        "--data.eval_path=", "--fault_tolerance.enabled=true",
        "--fault_tolerance.num_replica_groups=2", "--fault_tolerance.timeout_s=20",
        f"--fault_tolerance.lighthouse=http://localhost:{port}",
    ]  # fmt: skip
    logs = [work / f"g{g}.log" for g in (0, 1)]
    groups = [_group(g, train, logs[g]) for g in (0, 1)]
    try:
        _first_commit_after(job / "replica_1", 0)
        time.sleep(2)  # both groups stepping together
        killed = time.time()
        groups[1].send_signal(signal.SIGKILL)
        groups[1].wait()
        # Its first step without the dead group (one in flight may still commit with it).
        survivor_s = _first_commit_after(job / "replica_0", killed, alone=True) - killed
        time.sleep(1)
        launched = time.time()
        groups[1] = _group(1, train, logs[1])
        rejoin_s = _first_commit_after(job / "replica_1", launched) - launched
        time.sleep(2)
        for process in groups:
            process.send_signal(signal.SIGKILL)
            process.wait()
        reached = max(e["step"] for e in _events(job / "replica_0"))
        launched = time.time()
        groups = [_group(g, train, logs[g]) for g in (0, 1)]
        restart_s = _first_commit_after(job / "replica_0", launched) - launched
        regain_s = _first_commit_after(job / "replica_0", launched, reached) - launched
    finally:
        for process in groups:
            process.kill()
        lighthouse.kill()
    print(
        json.dumps(
            {
                "survivor_next_step_s": round(survivor_s, 3),
                "rejoin_s": round(rejoin_s, 3),
                "whole_job_restart_s": round(restart_s, 3),
                "whole_job_restart_regain_s": round(regain_s, 3),
                "rejoin_over_restart": round(rejoin_s / restart_s, 3),
                "survivor_over_restart": round(survivor_s / restart_s, 3),
            }
        )
    )


if __name__ == "__main__":
    main()
