"""Checkpoint saves and resumes into an S3 store (moto's server, its own process on this
host) against a local directory: sync save time and throughput, the async stall (what
save() keeps the caller) and commit time, and resume time, for one model after one AdamW
step, at checkpoint.store_connections = 1 and = --connections.

    python bench/store_checkpoints.py [--model 134M] [--rounds 3] [--connections 8]
                                      [--latency-ms 0]

Each figure is the median of --rounds saves (or resumes) by one manager, as in a run. The
store rows include staging: the save is written under checkpoint.staging_dir first and
uploaded from there. A local moto server is CPU-bound (it parses every request in Python
on this machine's cores), so its figures are a floor for what a real store serves; the
ratio of the two connection counts shows what parallel transfers buy. --latency-ms puts
a proxy adding that round trip to every request in front of the server.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from checkpoint_stall import MODELS, build_parts
from store_reads import LatencyProxy

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_moto(port: int) -> subprocess.Popen:
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise RuntimeError("moto's server did not start within 60 s") from None
            time.sleep(0.2)


def run_target(where: str, staging: Path, parts, mode: str, connections: int, rounds: int):
    """(seconds save() returned after, seconds until committed, bytes) per save, then the
    seconds of each resume (a fresh manager finds, checks and loads the newest)."""
    model, optimizer, scheduler = parts
    cfg = CheckpointConfig(
        async_mode=mode, keep_last_n=1, store_connections=connections, store_timeout_s=3600
    )
    manager = CheckpointManager(cfg, where, staging_dir=str(staging / "save"))
    saves = []
    for step in range(1, rounds + 2):  # the first save (allocating buffers) is not counted
        started = time.perf_counter()
        manager.save(step, model=model, optimizer=optimizer, scheduler=scheduler, train_state={})
        returned = time.perf_counter()
        manager.wait()
        saves.append((returned - started, time.perf_counter() - started))
    resumes = []
    for _ in range(rounds):
        shutil.rmtree(staging / "resume", ignore_errors=True)
        started = time.perf_counter()
        reader = CheckpointManager(cfg, where, staging_dir=str(staging / "resume"))
        path = reader.find_resume_path()
        assert path is not None, f"no checkpoint found in {where}"
        reader.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
        resumes.append(time.perf_counter() - started)
        size = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    return saves[1:], resumes, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="134M", choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    args = parser.parse_args()
    port = free_port()
    server = start_moto(port)
    if args.latency_ms > 0:
        port = LatencyProxy(("127.0.0.1", port), args.latency_ms / 1000).port
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_EC2_METADATA_DISABLED="true",
    )
    from kempnerforge.storage.stores import filesystem

    filesystem("s3://bench").mkdir("bench")
    parts = build_parts(MODELS[args.model])
    tmp = Path(tempfile.mkdtemp(prefix="store-ckpt-"))
    targets = [("local directory", str(tmp / "local"), 1)]
    targets += [(f"s3, {n} connection(s)", f"s3://bench/c{n}", n) for n in (1, args.connections)]
    print(
        f"model {args.model}, median of {args.rounds}, added latency {args.latency_ms:g} ms, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"{'target':>22} {'MB':>7} {'sync s':>7} {'sync MB/s':>9} {'async stall s':>13} "
        f"{'commit s':>8} {'resume s':>8} {'resume MB/s':>11}"
    )
    try:
        for label, where, connections in targets:
            row = {}
            for mode in ("disabled", "async"):
                saves, resumes, size = run_target(
                    where, tmp / f"staging-{mode}", parts, mode, connections, args.rounds
                )
                row[mode] = (
                    statistics.median(s[0] for s in saves),
                    statistics.median(s[1] for s in saves),
                )
                row["resume"] = statistics.median(resumes)
                row["mb"] = size / 1e6
            mb = row["mb"]
            print(
                f"{label:>22} {mb:>7.0f} {row['disabled'][1]:>7.2f} "
                f"{mb / row['disabled'][1]:>9.0f} {row['async'][0]:>13.3f} "
                f"{row['async'][1]:>8.2f} {row['resume']:>8.2f} {mb / row['resume']:>11.0f}"
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        server.kill()


if __name__ == "__main__":
    main()
