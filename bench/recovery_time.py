"""Reading a rank's state back after a fault, from the memory tier (checkpoint.memory_interval:
the node's shared memory) against a checkpoint on local disk and in an S3 store (moto's
server, its own process on this host), for one model after one AdamW step; and what taking
the memory copy costs the loop.

    python bench/recovery_time.py [--model 134M] [--rounds 3] [--connections 8]

Per target, the median of --rounds:
- copy s: the memory tier's blocking part (the snapshot into host memory the loop waits
  for; the file is written into the tmpfs on a background thread, its time in write s);
- resume s: from nothing in the process to the state in the live model, optimizer and
  scheduler: for the memory tier, the agreement on a step, a weights-only read of the
  rank's file and its copy into the live tensors; for a checkpoint, a fresh manager that
  finds, checks and loads the newest one (a store's: fetched into staging first).
The rest of a relaunch (interpreter, imports, building the model) is the same whichever
tier the state comes from, and is not in these figures.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from checkpoint_stall import MODELS, build_parts
from store_checkpoints import free_port, run_target, start_moto

from kempnerforge.checkpoint.memory_tier import MemoryTier, agreed_step, restore, snapshot


def memory_tier(root: Path, parts, rounds: int) -> tuple[float, float, float, int]:
    """(copy s, write s, resume s, bytes), medians."""
    model, optimizer, scheduler = parts
    tier = MemoryTier(root, rank=0)
    copies, writes, resumes = [], [], []
    for step in range(1, rounds + 1):
        started = time.perf_counter()
        state = snapshot(model, optimizer, scheduler, {"step": step})
        copied = time.perf_counter()
        tier.save(step, state)
        tier.wait()
        copies.append(copied - started)
        writes.append(time.perf_counter() - copied)
    size = (root / f"step_{rounds}" / "rank_0.pt").stat().st_size
    for _ in range(rounds):
        started = time.perf_counter()
        step = agreed_step(tier, None)
        assert step is not None
        restore(tier.load(step), model, optimizer, scheduler)
        resumes.append(time.perf_counter() - started)
    tier.clear()
    return (
        statistics.median(copies),
        statistics.median(writes),
        statistics.median(resumes),
        size,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="134M", choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--shm", default="/dev/shm", help="the tmpfs of the memory tier")
    args = parser.parse_args()
    parts = build_parts(MODELS[args.model])
    tmp = Path(tempfile.mkdtemp(prefix="recovery-"))
    shm = Path(tempfile.mkdtemp(prefix="recovery-", dir=args.shm))
    print(f"model {args.model}, median of {args.rounds}, load {os.getloadavg()[0]:.2f}")
    print(f"{'source':>22} {'MB':>7} {'copy s':>7} {'write s':>8} {'resume s':>9} {'x memory':>9}")
    copy_s, write_s, memory_s, size = memory_tier(shm / "tier", parts, args.rounds)
    row = f"{size / 1e6:>7.0f} {copy_s:>7.3f} {write_s:>8.3f} {memory_s:>9.3f} {1.0:>9.1f}"
    print(f"{'memory tier (tmpfs)':>22} {row}")
    port = free_port()
    server = start_moto(port)
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
        AWS_EC2_METADATA_DISABLED="true",
    )
    from kempnerforge.storage.stores import filesystem

    filesystem("s3://bench").mkdir("bench")
    targets = [("checkpoint, local disk", str(tmp / "local"), 1)]
    targets += [(f"checkpoint, s3 x{args.connections}", "s3://bench/r", args.connections)]
    try:
        for label, where, connections in targets:
            _, resumes, size = run_target(
                where, tmp / "staging", parts, "disabled", connections, args.rounds
            )
            resume = statistics.median(resumes)
            print(
                f"{label:>22} {size / 1e6:>7.0f} {'-':>7} {'-':>8} {resume:>9.3f} "
                f"{resume / memory_s:>9.1f}"
            )
    finally:
        server.kill()
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


if __name__ == "__main__":
    main()
