"""Mixture-of-Experts speed on this machine: the MoE debug model against the dense one, and
the grouped expert compute against a loop over experts.

1. Training tokens/s of `kempnerforge train` for configs/train/debug.toml (dense, 3.5M
   parameters) and configs/train/debug_moe.toml (8 experts, top-2, each half the dense
   width: 10.6M parameters, 3.6M active per token), alternating in each round; medians
   over the rounds, from the end of warm-up step --skip to the last step.
2. One MoE layer of the debug_moe shape (forward and backward of routing, dispatch,
   experts and combine over batch x seq tokens) with the experts computed by
   torch._grouped_mm, by a batched matmul over padded groups, and by one matmul per
   expert; the three alternate in each repetition, under an even and a skewed router.
Run alone on the machine.

    python bench/moe.py
    python bench/moe.py --rounds 3 --steps 25 --layer-repeats 20
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from throughput import Variant, run_framework

from kempnerforge.config.loader import load_config
from kempnerforge.model.moe.layer import MoEFeedForward
from kempnerforge.model.weight_init import fill_parameter

COMPUTES = ("grouped_mm", "padded_bmm", "looped")


def training(args: argparse.Namespace) -> None:
    configs = {"dense (debug)": "configs/train/debug.toml", "moe (debug_moe)": args.moe_config}
    runs: dict[str, list[float]] = {name: [] for name in configs}
    memory: dict[str, list[float]] = {name: [] for name in configs}
    for i in range(args.rounds):
        for name, path in configs.items():
            args.config_file = path
            result = run_framework(args, Variant(name))
            runs[name].append(result.tokens_per_sec)
            memory[name].append(result.peak_memory_gib)
        line = " | ".join(f"{n} {r[-1]:,.0f}" for n, r in runs.items())
        print(f"round {i + 1} (tok/s): {line}", flush=True)
    dense = statistics.median(runs["dense (debug)"])
    print(f"\n{'model':20} {'tok/s':>9} {'x dense':>8} {'peak GiB':>9}")
    for name, values in runs.items():
        tps = statistics.median(values)
        print(f"{name:20} {tps:9,.0f} {tps / dense:8.3f} {statistics.median(memory[name]):9.2f}")


def moe_layer(path: str, skewed: bool) -> MoEFeedForward:
    cfg = load_config(path, []).model
    torch.manual_seed(0)
    layer = MoEFeedForward(cfg)
    with torch.no_grad():
        for i, param in enumerate(layer.parameters()):
            fill_parameter(param, 0.02, i)
    if skewed:
        with torch.no_grad():  # with input channel 0 at 1 (below), low experts are preferred
            layer.router.gate.weight[:, 0] += torch.linspace(2.0, 0.0, cfg.num_experts)
    return layer


def time_layer(layer: MoEFeedForward, x: torch.Tensor, compute: str) -> float:
    layer.experts.compute = compute
    start = time.perf_counter()
    out = layer(x)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def layer_bench(args: argparse.Namespace) -> None:
    print(f"\nMoE layer, {args.batch_size} x {args.seq_len} tokens, forward + backward (ms)")
    print(f"{'router':8} {'max/mean load':>14} " + " ".join(f"{c:>11}" for c in COMPUTES))
    for skewed in (False, True):
        layer = moe_layer(args.moe_config, skewed)
        dim = layer.router.gate.weight.shape[1]
        x = torch.randn(args.batch_size, args.seq_len, dim)
        x[..., 0] = 1.0
        x.requires_grad_()
        for compute in COMPUTES:  # warm-up
            time_layer(layer, x, compute)
        times: dict[str, list[float]] = {c: [] for c in COMPUTES}
        for _ in range(args.layer_repeats):
            for compute in COMPUTES:
                times[compute].append(time_layer(layer, x, compute))
        load = layer.last.load if layer.last is not None else torch.ones(1)
        imbalance = float(load.max() / load.mean())
        cells = " ".join(f"{statistics.median(times[c]) * 1e3:11.1f}" for c in COMPUTES)
        print(f"{'skewed' if skewed else 'even':8} {imbalance:14.2f} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--moe-config", default="configs/train/debug_moe.toml")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument("--layer-repeats", type=int, default=20)
    parser.add_argument("--no-training", action="store_true", help="the layer bench only")
    args = parser.parse_args()
    if not args.no_training:
        training(args)
    layer_bench(args)


if __name__ == "__main__":
    main()
