"""Peak host memory of a rank while it builds its sharded model, against its shard's size.

Starts ``--ranks`` gloo processes on the CPU. Each imports everything, joins the group and
notes its resident memory; then builds its model as training does (build_model_on_mesh:
meta -> parallelize -> to_empty -> init_weights) and reports its peak resident memory
(getrusage ru_maxrss) minus that baseline, beside the bytes of its own parameter shards
and of the largest whole parameter. A rank that drew whole parameters peaks at about its
shards plus the largest whole parameter; one that draws only its shard, at its shards.
The default model (2 layers, dim 1024, a 65,536-token vocabulary, untied) puts most of
its weights in the embedding and the head, 256 MiB each in fp32. Overrides
(``--section.field=value``) change the model or the layout.

    python bench/init_memory.py [--ranks 2] [--model.vocab_size=131072 ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.training.build import build_model_on_mesh
from kempnerforge.training.loss import build_loss_fn

MODEL = [
    "--model.dim=1024",
    "--model.n_layers=2",
    "--model.n_heads=8",
    "--model.vocab_size=65536",
    "--model.max_seq_len=256",
    "--model.tie_embeddings=false",
]
MIB = 1 << 20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


def _rank(rank: int, world_size: int, store: str, overrides: list[str], out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
    config = load_config(None, [*MODEL, "--train.device=cpu", *overrides])
    config.validate(world_size)
    runtime = init_runtime(config.distributed, "cpu")
    baseline = _resident_bytes()
    model, _ = build_model_on_mesh(config, runtime, build_loss_fn(config.train))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    params = list(model.parameters())
    shard = sum(_local(p).numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as f:
        f.write(f"{rank} {(peak - baseline) / MIB:.0f} {shard / MIB:.0f} {largest / MIB:.0f}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    args, overrides = parser.parse_known_args()
    with tempfile.TemporaryDirectory() as out:
        store = os.path.join(out, "store")
        mp.spawn(_rank, args=(args.ranks, store, overrides, out), nprocs=args.ranks)
        rows = [Path(out, f"rank{r}.txt").read_text().split() for r in range(args.ranks)]
    print("rank  peak over baseline (MiB)  own shards (MiB)  largest whole parameter (MiB)")
    for rank, peak, shard, largest in rows:
        print(f"{rank:>4}  {peak:>24}  {shard:>16}  {largest:>29}")


if __name__ == "__main__":
    main()
