"""Tokens/s and peak memory of a training step over packed documents: attention through
the mask rules' kernel (train.attention_kernel = "auto"), through the dense (batch, 1, seq,
seq) mask ("dense"), and a plain causal step (one document a row) at the same length.

A step is the framework's model (the debug preset's shape, max_seq_len raised to the
sequence) on one batch row of --seq tokens cut into documents of --doc-len tokens (the
last one shorter), forward with the fused head loss, backward and a fused AdamW step, fp32.
Each (path, length, round) runs in a fresh process, so no allocator cache or earlier peak
carries over; rounds alternate the paths. Time: the median of --steps steps after
--warmup; tokens/s is --seq over it, and tokens per CPU-second is --seq over the median
CPU time of the process in a step (the work done, which other load on the machine
changes far less than the wall clock; with --threads 1 it has no idle spinning in it).
Memory: the increase of the process's peak resident set (VmHWM, reset through
/proc/self/clear_refs where Linux allows) over its value with the model, optimizer and
batch built, so the first step's optimizer state counts. The
load average is read before and after each run. Prints one JSON line per run, then the
medians and the ratios (rules over dense for tokens/s and per CPU-second, rules over
causal for memory).

    python bench/attention.py --seq 4096,16384 --paths rules,dense
    python bench/attention.py --seq 32768,65536 --paths rules,causal --steps 1 --warmup 0
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
from kempnerforge.model import build_model
from kempnerforge.model.heads import HeadLossSpec

PATHS = {"rules": "auto", "dense": "dense", "causal": "auto"}
"""train.attention_kernel of each path; 'causal' gives the model no document ids."""


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
        pass  # the figure is then the peak since start-up, over the same baseline


def packed_doc_ids(seq: int, doc_len: int) -> torch.Tensor:
    """(1, seq): documents of doc_len tokens, numbered from 0."""
    return (torch.arange(seq) // doc_len)[None]


def run_one(path: str, seq: int, args: argparse.Namespace) -> dict:
    """One process's measurement of ``path`` at ``seq`` tokens."""
    load_before = os.getloadavg()[0]
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # configs/model/debug.toml's shape, its n_layers from --layers.
    cfg = ModelConfig(
        dim=256, n_heads=4, n_kv_heads=4, vocab_size=259, n_layers=args.layers, max_seq_len=seq
    )
    model = build_model(cfg)
    model.attention_kernel = PATHS[path]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    labels = torch.randint(0, cfg.vocab_size, (1, seq))
    doc_ids = None if path == "causal" else packed_doc_ids(seq, args.doc_len)
    spec = HeadLossSpec(2048, 0.0)
    _reset_peak()
    baseline = _peak_kib()
    times, cpu_times = [], []
    for _ in range(args.warmup + args.steps):
        started, cpu_started = time.perf_counter(), time.process_time()
        head = model(ids, doc_ids, labels=labels, loss_spec=spec)
        (head.loss_sum / seq).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
        cpu_times.append(time.process_time() - cpu_started)
    step_s = statistics.median(times[args.warmup :])
    cpu_s = statistics.median(cpu_times[args.warmup :])
    return {
        "path": path,
        "seq": seq,
        "doc_len": None if doc_ids is None else args.doc_len,
        "layers": args.layers,
        "threads": torch.get_num_threads(),
        "step_s": round(step_s, 3),
        "tokens_per_sec": round(seq / step_s, 1),
        "cpu_s": round(cpu_s, 3),
        "tokens_per_cpu_sec": round(seq / cpu_s, 1),
        "peak_memory_gib": round((_peak_kib() - baseline) / 2**20, 3),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
    }


def _child_argv(path: str, seq: int, args: argparse.Namespace) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--one",
        path,
        "--seq",
        str(seq),
        f"--doc-len={args.doc_len}",
        f"--layers={args.layers}",
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--threads={args.threads}",
    ]


def summarize(rows: list[dict]) -> None:
    """Medians per (path, seq), and the ratios the docs quote."""
    by = {}
    for row in rows:
        by.setdefault((row["path"], row["seq"]), []).append(row)
    for seq in sorted({s for _, s in by}):
        line = {"seq": seq}
        for path in PATHS:
            got = by.get((path, seq))
            for key in ("tokens_per_sec", "tokens_per_cpu_sec", "peak_memory_gib"):
                if got:
                    line[f"{path}_{key}"] = statistics.median(r[key] for r in got)
        for key in ("tokens_per_sec", "tokens_per_cpu_sec"):
            if f"rules_{key}" in line and f"dense_{key}" in line:
                line[f"rules_over_dense_{key}"] = round(
                    line[f"rules_{key}"] / line[f"dense_{key}"], 2
                )
        if "rules_peak_memory_gib" in line and "causal_peak_memory_gib" in line:
            line["rules_over_causal_memory"] = round(
                line["rules_peak_memory_gib"] / line["causal_peak_memory_gib"], 2
            )
        print(json.dumps({"summary": line}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--seq", default="4096,16384", help="comma-separated lengths")
    parser.add_argument("--paths", default="rules,dense", help=f"from {', '.join(PATHS)}")
    parser.add_argument("--doc-len", type=int, default=700)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=0, help="0: torch's default")
    parser.add_argument("--one", choices=sorted(PATHS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one, int(args.seq), args)), flush=True)
        return 0
    rows = []
    for _ in range(args.rounds):
        for seq in (int(s) for s in args.seq.split(",")):
            for path in args.paths.split(","):
                done = subprocess.run(
                    _child_argv(path, seq, args), capture_output=True, text=True, check=False
                )
                if done.returncode != 0:
                    print(done.stderr[-2000:], file=sys.stderr)
                    return 1
                row = json.loads(done.stdout.strip().splitlines()[-1])
                print(json.dumps(row), flush=True)
                rows.append(row)
    summarize(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
