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
each number is the median over the rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.model import build_model
from kempnerforge.model.head_loss import HeadLossSpec
from kempnerforge.training.loss import build_loss_fn

SHAPE = {"vocab_size": 32000, "dim": 256, "n_layers": 4, "n_heads": 4, "max_seq_len": 256}
BATCH, SEQ = 8, 256


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


def measure(chunk_tokens: int, repeats: int, device: torch.device, bf16: bool) -> dict:
    """One variant in this process: peak memory of the first pass, median time of the rest."""
    torch.manual_seed(0)
    with torch.device(device):
        model = build_model(ModelConfig(**SHAPE))
    ids = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), device=device)
    labels = torch.randint(0, SHAPE["vocab_size"], (BATCH, SEQ), device=device)
    loss_fn = build_loss_fn(TrainConfig())
    spec = HeadLossSpec(chunk_tokens=chunk_tokens)

    def step() -> tuple[float, float]:
        start, start_cpu = time.perf_counter(), time.process_time()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if chunk_tokens > 0:
                loss = model(ids, labels=labels, loss_spec=spec).loss_sum
            else:
                loss = loss_fn(model(ids), labels)
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
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.repeats, device, args.bf16)))
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    rounds: dict[int, list[dict]] = {chunk: [] for chunk in chunks}
    for _ in range(args.rounds):  # interleaved, so a change in the machine's load hits all
        for chunk in chunks:
            command = [sys.executable, os.path.abspath(__file__), f"--one={chunk}"]
            command += [f"--repeats={args.repeats}", f"--device={args.device}"]
            command += ["--bf16"] if args.bf16 else []
            out = subprocess.run(command, check=True, capture_output=True, text=True)
            rounds[chunk].append(json.loads(out.stdout.strip().splitlines()[-1]))
    runs = [_median_run(chunk, rounds[chunk]) for chunk in chunks]
    shape = {**SHAPE, "batch_size": BATCH, "seq_len": SEQ}
    print(
        json.dumps(
            {
                "device": args.device,
                "bf16": args.bf16,
                "threads": torch.get_num_threads(),
                "shape": shape,
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
