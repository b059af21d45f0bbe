"""Peak memory per rank and tokens/s of one long sequence under context parallelism
(distributed.cp = 1, 2, 4): the debug model's shape, one sequence of --seq tokens, with the
heads exchanged around attention (--attention ulysses, model/attention/sequence_split.py)
or key/value blocks passed around a ring (--attention ring, model/attention/ring.py).

Each cp degree runs in fresh processes (gloo on CPU, one per cp rank, one intra-op thread
each), so no allocator cache or earlier peak carries over; they are forked from a server
that has only imported torch and the model code, which a rank would otherwise import again
for each degree. Every rank builds the same
model (seeded) and keeps its positions of the sequence (a slice, or a ring's zigzag
chunks). --part model runs forward + backward of the summed cross-entropy, and the
gradients are then summed over the ranks, as FSDP's reduction would; --part attention runs
one attention layer (projections, RoPE, attention) forward + backward on random inputs of
the rank's positions, the activations ring attention is meant to divide by cp. Causal
attention over the whole sequence, no document mask, fp32.

Memory: the increase of each rank's peak resident set (VmHWM, reset through
/proc/self/clear_refs where Linux allows, else ru_maxrss) over its value just before the
first pass of the sequence, with the model and its inputs already resident and a short
pass of 64 positions a rank run before it (so kernels and connections are set up); it
counts the transient buffers too (a ring's blocks in flight, the exchanged heads); and
the activations, the bytes of the tensors the forward saves for backward
(saved_tensors_hooks; each storage once, the weights left out); the largest over the
ranks is reported for each. Time: wall clock of the second pass, slowest rank; tokens/s
is --seq over it.
The all-to-alls and the ring's point-to-point passes (each a send to the next ring rank
and a receive from the previous) per pass are counted on rank 0. Prints one JSON line per
cp degree.

    python bench/context_parallel.py [--seq 16384] [--cps 1,2,4] [--attention ulysses|ring]
        [--part model|attention]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from kempnerforge.config.model import ModelConfig
from kempnerforge.model import build_model
from kempnerforge.model.attention import ring as ring_module
from kempnerforge.model.attention import sequence_split as split_module
from kempnerforge.model.attention.sequence_split import (
    SequenceSplit,
    held_spans,
    set_sequence_split,
)

PRELOADED = ["torch", "torch.distributed", "kempnerforge.model"]
"""Imported once by the server the ranks are forked from."""
WARM_UP_POSITIONS = 64
"""Positions per rank of the short pass before the measured ones."""
DEBUG_SHAPE = {"dim": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "vocab_size": 259}
"""configs/model/debug.toml (max_seq_len raised to the sequence)."""


def _peak_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the figure is then the peak since start-up, still over the same baseline


def _rank(rank: int, cp: int, seq: int, workdir: str, attention: str, part: str) -> None:
    torch.set_num_threads(1)
    if cp > 1:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{workdir}/store",
            rank=rank,
            world_size=cp,
            timeout=datetime.timedelta(seconds=1800),
        )
    torch.manual_seed(0)
    model = build_model(ModelConfig(**DEBUG_SHAPE, max_seq_len=seq))
    ids = torch.randint(0, DEBUG_SHAPE["vocab_size"], (1, seq + 1))
    ring = cp if attention == "ring" and cp > 1 else 1
    mine = torch.cat([torch.arange(a, b) for a, b in held_spans(rank, cp, seq, ring)])
    inputs, labels = ids[:, mine], ids[:, mine + 1]
    exchanges, passes = [0], [0]
    if cp > 1:
        set_sequence_split(model, SequenceSplit(dist.group.WORLD, rank, cp, ring=ring))
        inner, inner_pass = split_module._exchange, ring_module.RingPlan.pass_on

        def counted(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
            exchanges[0] += 1
            return inner(x, group)

        def counted_pass(plan: ring_module.RingPlan, x: torch.Tensor, tag: int):
            passes[0] += 1
            return inner_pass(plan, x, tag)

        split_module._exchange = counted
        ring_module.RingPlan.pass_on = counted_pass  # type: ignore[method-assign]
    layer = model.layers["0"].attention
    hidden = torch.randn(1, len(mine), DEBUG_SHAPE["dim"], requires_grad=True)

    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    def one_pass(length: int = len(mine)) -> None:
        # What the forward keeps for backward (the activations), weights left out.
        with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
            if part == "attention":
                cos, sin = model.rope(length)
                # The layer's mask as the model prepares it (a RingMask under a ring).
                mask = model.attention_masks(None, 1, length, hidden.device)["0"]
                loss = layer(hidden[:, :length], cos, sin, mask).sum()
            else:
                logits = model(inputs[:, :length])
                targets = labels[:, :length].flatten()
                loss = F.cross_entropy(logits.flatten(0, 1), targets, reduction="sum")
        loss.backward()
        if cp > 1:
            for param in model.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad)
        model.zero_grad(set_to_none=True)
        hidden.grad = None

    # A short pass first pays what any first pass pays (kernels' code and workspaces,
    # the group's connections), so the peak below is this sequence's own.
    one_pass(WARM_UP_POSITIONS)
    saved.clear()
    # Memory of the first long pass: later ones reuse pages the allocator kept resident,
    # which a peak-resident-set figure cannot see. Time of the second: set-up is paid.
    _reset_peak()
    before = _peak_kib()
    one_pass()
    peak_gib = (_peak_kib() - before) / 2**20
    saved_gib = sum(saved.values()) / 2**30
    exchanges[0] = passes[0] = 0
    if cp > 1:
        dist.barrier()
    started = time.perf_counter()
    one_pass()
    elapsed = time.perf_counter() - started
    with open(os.path.join(workdir, f"rank{rank}.json"), "w") as f:
        record = {"peak_gib": peak_gib, "saved_gib": saved_gib, "s": elapsed}
        record["exchanges"] = exchanges[0]
        json.dump({**record, "ring_passes": passes[0]}, f)
    if cp > 1:
        dist.barrier()
        dist.destroy_process_group()


def measure(cp: int, seq: int, attention: str = "ulysses", part: str = "model") -> dict:
    """One cp degree in fresh processes: the slowest rank's time, the largest peak."""
    with tempfile.TemporaryDirectory() as workdir:
        args = (cp, seq, workdir, attention, part)
        mp.set_forkserver_preload(PRELOADED)  # no effect once the server runs
        mp.start_processes(_rank, args=args, nprocs=cp, start_method="forkserver")
        ranks = []
        for rank in range(cp):
            with open(os.path.join(workdir, f"rank{rank}.json")) as f:
                ranks.append(json.load(f))
    seconds = max(r["s"] for r in ranks)
    return {
        "cp": cp,
        "attention": attention if cp > 1 else "one process",
        "part": part,
        "seq": seq,
        "peak_gib_per_rank": round(max(r["peak_gib"] for r in ranks), 3),
        "saved_gib_per_rank": round(max(r["saved_gib"] for r in ranks), 3),
        "pass_s": round(seconds, 2),
        "tokens_per_sec": round(seq / seconds, 1),
        "all_to_alls_per_pass": ranks[0]["exchanges"],
        "ring_passes_per_pass": ranks[0]["ring_passes"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--attention", choices=("ulysses", "ring"), default="ulysses")
    parser.add_argument("--part", choices=("model", "attention"), default="model")
    args = parser.parse_args(argv)
    for cp in (int(c) for c in args.cps.split(",")):
        print(json.dumps(measure(cp, args.seq, args.attention, args.part)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
