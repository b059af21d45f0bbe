"""Reading a rank's state back after a fault, from the memory tier (checkpoint.memory_interval:
the node's shared memory) against a checkpoint on local disk and in an S3 store (moto's
server, its own process on this host), for one model after one AdamW step; and what taking
the memory copy costs the loop.

    python bench/recovery_time.py [--model 134M] [--rounds 3] [--connections 8]
                                  [--no-peer]

Per target, the median of --rounds:
- copy s: the memory tier's blocking part (the snapshot into host memory the loop waits
  for; the file is written into the tmpfs on a background thread, its time in write s);
- resume s: from nothing in the process to the state in the live model, optimizer and
  scheduler: for the memory tier, the agreement on a step, a weights-only read of the
  rank's file and its copy into the live tensors; for a checkpoint, a fresh manager that
  finds, checks and loads the newest one (a store's: fetched into staging first).
- the memory tier from a peer node: two gloo ranks on this host, each a "node" with a
  folder of its own; rank 0's folder is removed (its node lost), and its resume is the
  agreement, the transfer of its copy from the rank that kept it (over loopback TCP here:
  a floor for a real network's time) and the copy into the live tensors.
The rest of a relaunch (interpreter, imports, building the model) is the same whichever
tier the state comes from, and is not in these figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from checkpoint_stall import MODELS, build_parts
from store_checkpoints import free_port, run_target, start_moto

from kempnerforge.checkpoint.memory_peer import build_peer_link
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


def _peer_rank(rank: int, root: str, model: str, rounds: int) -> None:
    """One rank of the peer measurement (see the module's docstring); rank 0 writes its
    median resume seconds and its copy's bytes to <root>/peer.json."""
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/rendezvous", rank=rank, world_size=2
    )
    link = build_peer_link(rank, 2, local_world_size=1)
    node = Path(root) / f"node{rank}"
    tier = MemoryTier(node / "tier", rank, peer=link)
    parts = build_parts(MODELS[model]) if rank == 0 else None  # rank 1 only keeps the copy
    resumes = []
    for step in range(1, rounds + 1):
        state = snapshot(*parts, {"step": step}) if parts is not None else {"step": step}
        copy = Path(tier.save(step, state))  # taken back from the peer below
        tier.wait()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(node)  # node 0 lost: its copies and the ones it kept
        dist.barrier()
        started = time.perf_counter()
        agreed = agreed_step(tier, dist.group.WORLD)
        assert agreed is not None and agreed == step
        tier.fetch(agreed)
        if parts is not None:
            restore(tier.load(agreed), *parts)
        resumes.append(time.perf_counter() - started)
    if rank == 0:
        size = copy.stat().st_size
        result = {"resume_s": statistics.median(resumes), "bytes": size}
        (Path(root) / "peer.json").write_text(json.dumps(result))
    tier.clear()
    dist.destroy_process_group()


def peer_copy(model: str, rounds: int) -> tuple[float, int]:
    """(resume s, bytes) of rank 0 taking its copy back from its peer, median."""
    root = tempfile.mkdtemp(prefix="recovery-peer-", dir="/dev/shm")
    try:
        mp.start_processes(_peer_rank, args=(root, model, rounds), nprocs=2, start_method="spawn")
        result = json.loads((Path(root) / "peer.json").read_text())
        return result["resume_s"], result["bytes"]
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="134M", choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--shm", default="/dev/shm", help="the tmpfs of the memory tier")
    parser.add_argument("--no-peer", action="store_true", help="skip the peer node's copy")
    args = parser.parse_args()
    parts = build_parts(MODELS[args.model])
    tmp = Path(tempfile.mkdtemp(prefix="recovery-"))
    shm = Path(tempfile.mkdtemp(prefix="recovery-", dir=args.shm))
    print(f"model {args.model}, median of {args.rounds}, load {os.getloadavg()[0]:.2f}")
    print(f"{'source':>22} {'MB':>7} {'copy s':>7} {'write s':>8} {'resume s':>9} {'x memory':>9}")
    copy_s, write_s, memory_s, size = memory_tier(shm / "tier", parts, args.rounds)
    row = f"{size / 1e6:>7.0f} {copy_s:>7.3f} {write_s:>8.3f} {memory_s:>9.3f} {1.0:>9.1f}"
    print(f"{'memory tier (tmpfs)':>22} {row}")
    if not args.no_peer:
        peer_s, peer_size = peer_copy(args.model, args.rounds)
        row = f"{peer_size / 1e6:>7.0f} {'-':>7} {'-':>8} {peer_s:>9.3f} {peer_s / memory_s:>9.1f}"
        print(f"{'memory tier, from peer':>22} {row}")
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
