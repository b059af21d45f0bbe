"""Peak memory and time of one forward+backward with the chunked output-head loss against
whole logits (train.loss_chunk_tokens = 0).

The model is vocab 32000, dim 256, 4 layers, 4 heads (built with ModelConfig and
build_model), on batch 8 x seq 256 random tokens, in fp32 (the CPU default; --bf16 runs
under bf16 autocast). That is 2048 tokens per pass, so a chunk size of 2048 or more is
one chunk: the whole logits still exist, once, but none is kept for backward. Every
chunk size runs in a fresh process, so no allocator cache or earlier peak carries over.

Memory: on CPU the increase of the process's peak resident set (getrusage ru_maxrss)
over its value just before the first forward+backward, with the model, its inputs and
everything imported already resident; it counts every byte the step touched at its
worst moment (activations, logits, gradients, allocator slack). On CUDA it is
torch.cuda.max_memory_allocated over the allocation before the step.

Time: the median of ``--repeats`` forward+backward passes after one untimed warm-up (the
measured first pass), gradients dropped between passes as the optimizer's zero_grad
does: wall clock (median_s) and, since a shared machine's load skews wall clock, the
process's CPU time over all threads (median_cpu_s). Prints one JSON line.

    python bench/loss_memory.py [--chunks 0,512,1024,2048,4096,8192] [--repeats 5] [--rounds 1]

With ``--rounds`` above 1 the chunk sizes take turns, each round in fresh processes, and
each number is the median over the rounds. ``--vocab`` changes the vocabulary size.

``--layout`` picks where the head and its loss run: ``single`` (the whole model in one
process), ``stage`` (the model as one pipeline stage, StageModule, which returns whole
logits for the schedule's loss with chunk 0 and computes the chunked loss itself from the
labels otherwise) or ``tp`` (two gloo ranks with tensor parallelism, apply_tp: with chunk
0 the head gathers whole logits on every rank, otherwise each rank computes the
vocabulary-parallel chunked loss over its vocabulary shard). Under ``tp`` each figure is
the larger of the two ranks' (every rank holds the same share).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.distributed.pipeline_parallel import StageModule
from kempnerforge.distributed.tensor_parallel import apply_tp
from kempnerforge.model import build_model
from kempnerforge.model.heads.head_loss import HeadLoss, HeadLossSpec
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.loss import build_loss_fn

SHAPE = {"vocab_size": 32000, "dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 256}
BATCH, SEQ = 8, 256
TP = 2


def _start_peak(device: torch.device) -> int:
    """The bytes the step's peak is measured from; on CUDA, also restarts the peak."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    return _peak_bytes(device)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _model(layout: str, vocab: int, device: torch.device) -> tuple[Transformer, nn.Module]:
    """The model (parallelised under tp) and the module whose forward runs the step."""
    cfg = ModelConfig(**{**SHAPE, "vocab_size": vocab})
    if layout != "tp":
        with torch.device(device):
            model = build_model(cfg)
        return model, StageModule(model, 0, 1, (0, cfg.n_layers)) if layout == "stage" else model
    with torch.device("meta"):
        model = build_model(cfg)
    apply_tp(model, init_device_mesh(device.type, (TP,), mesh_dim_names=("tp",)))
    model.to_empty(device=device)
    model.init_weights(seed=0)
    return model, model


def measure(
    chunk_tokens: int, repeats: int, device: torch.device, bf16: bool, layout: str, vocab: int
) -> dict:
    """One variant in this process: peak memory of the first pass, median time of the rest."""
    torch.manual_seed(0)
    model, forward = _model(layout, vocab, device)
    ids = torch.randint(0, vocab, (BATCH, SEQ), device=device)
    labels = torch.randint(0, vocab, (BATCH, SEQ), device=device)
    loss_fn = build_loss_fn(TrainConfig())
    spec = HeadLossSpec(chunk_tokens=chunk_tokens)
    if isinstance(forward, StageModule):
        forward.loss_spec = spec if chunk_tokens > 0 else None

    def loss_of_step() -> torch.Tensor:
        if isinstance(forward, StageModule):
            out = forward(ids, labels=labels)
            return HeadLoss(*out).loss_sum if isinstance(out, tuple) else loss_fn(out, labels)
        if chunk_tokens > 0:
            return forward(ids, labels=labels, loss_spec=spec).loss_sum
        return loss_fn(forward(ids), labels)

    def step() -> tuple[float, float]:
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_of_step()
        loss.backward()
        _sync(device)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start, time.process_time() - start_cpu

    _sync(device)
    before = _start_peak(device)
    step()
    peak = _peak_bytes(device) - before
    wall, cpu = zip(*(step() for _ in range(repeats)), strict=True)
    return {
        "chunk_tokens": chunk_tokens,
        "peak_mib": round(peak / 2**20, 1),
        "median_s": round(statistics.median(wall), 4),
        "median_cpu_s": round(statistics.median(cpu), 4),
    }


def _tp_rank(rank: int, init_file: str, args: argparse.Namespace, results: str) -> None:
    """One tensor-parallel rank of a ``--layout tp`` variant: measure, write its JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    try:
        device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
        run = measure(args.one, args.repeats, device, args.bf16, "tp", args.vocab)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    with open(os.path.join(results, f"{rank}.json"), "w") as f:
        json.dump(run, f)


def _measure_tp(args: argparse.Namespace) -> dict:
    """A ``--layout tp`` variant on TP gloo ranks: each number the largest rank's."""
    with tempfile.TemporaryDirectory() as workdir:
        init_file = os.path.join(workdir, "store")
        mp.spawn(_tp_rank, args=(init_file, args, workdir), nprocs=TP)
        ranks = []
        for rank in range(TP):
            with open(os.path.join(workdir, f"{rank}.json")) as f:
                ranks.append(json.load(f))
    keys = ("peak_mib", "median_s", "median_cpu_s")
    return {"chunk_tokens": args.one} | {key: max(run[key] for run in ranks) for key in keys}


def _median_run(chunk_tokens: int, rounds: list[dict]) -> dict:
    """One chunk size over its rounds: the median of each number."""
    keys = ("peak_mib", "median_s", "median_cpu_s")
    return {"chunk_tokens": chunk_tokens} | {
        key: round(statistics.median(run[key] for run in rounds), 4) for key in keys
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default=f"0,{TrainConfig().loss_chunk_tokens}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=1, help="fresh processes per chunk size")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bf16", action="store_true", help="run under bf16 autocast")
    parser.add_argument("--layout", choices=("single", "stage", "tp"), default="single")
    parser.add_argument("--vocab", type=int, default=SHAPE["vocab_size"])
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.one is not None and args.layout == "tp":
        print(json.dumps(_measure_tp(args)))
        return
    if args.one is not None:
        run = measure(args.one, args.repeats, device, args.bf16, args.layout, args.vocab)
        print(json.dumps(run))
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    rounds: dict[int, list[dict]] = {chunk: [] for chunk in chunks}
    for _ in range(args.rounds):  # interleaved, so a change in the machine's load hits all
        for chunk in chunks:
            command = [sys.executable, os.path.abspath(__file__), f"--one={chunk}"]
            command += [f"--repeats={args.repeats}", f"--device={args.device}"]
            command += [f"--layout={args.layout}", f"--vocab={args.vocab}"]
            command += ["--bf16"] if args.bf16 else []
            out = subprocess.run(command, check=True, capture_output=True, text=True)
            rounds[chunk].append(json.loads(out.stdout.strip().splitlines()[-1]))
    runs = [_median_run(chunk, rounds[chunk]) for chunk in chunks]
    shape = {**SHAPE, "vocab_size": args.vocab, "batch_size": BATCH, "seq_len": SEQ}
    print(
        json.dumps(
            {
                "device": args.device,
                "bf16": args.bf16,
                "layout": args.layout,
                "threads": torch.get_num_threads(),
                "shape": shape,
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
