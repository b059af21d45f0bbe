"""Milliseconds per `optimizer.step()` for every optimizer and optimizer.implementation.

Two models built through kempnerforge's ModelConfig / build_model: a 32000-token vocabulary
at dim 256, 4 layers, 4 heads (19.8M parameters, 83% of them in the embedding and the
output head), and the debug preset (configs/train/debug.toml: the same blocks, 259-token
vocabulary). Every parameter gets a fixed random gradient; nothing runs forward or backward.

The first row is `torch.optim.AdamW(model.parameters())` with its defaults, what a plain
PyTorch loop writes. The optimizers step in turn, one step each per round in a shuffled
order, so load from other processes (and what the previous step left in the caches and
the allocator) spreads over all of them alike; after `--warmup` rounds, the median of
`--steps` timed rounds is reported: step_ms (wall clock) and cpu_ms (this process's CPU
time, all threads), with min_ms, the fastest step (on a shared machine the rows whose
median moved with other load still show it there). One JSON line per (model, optimizer,
implementation).

    python bench/optimizer_step.py [--steps 20] [--warmup 3] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable

import torch

from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.optimizer import IMPLEMENTATIONS, OptimizerConfig
from kempnerforge.model import build_model
from kempnerforge.optim.optimizer import build_optimizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# What each optimizer is run with (typical settings; the step time does not depend on them).
SETTINGS = {
    "adamw": OptimizerConfig(name="adamw", lr=3e-4),
    "lion": OptimizerConfig(name="lion", lr=1e-4, betas=[0.9, 0.99], weight_decay=1.0),
    "muon": OptimizerConfig(name="muon", lr=0.02, muon_adam_lr=3e-4),
    "schedule_free_adamw": OptimizerConfig(name="schedule_free_adamw", betas=[0.9, 0.999]),
}


def models() -> dict[str, ModelConfig]:
    debug = load_config(os.path.join(REPO, "configs/train/debug.toml")).model
    return {
        "vocab32000_dim256_4layers": ModelConfig(dim=256, n_layers=4, n_heads=4, vocab_size=32000),
        "debug": debug,
    }


def optimizers(model: torch.nn.Module) -> dict[tuple[str, str], torch.optim.Optimizer]:
    built: dict[tuple[str, str], torch.optim.Optimizer] = {
        ("torch.optim.AdamW", "torch default"): torch.optim.AdamW(model.parameters())
    }
    for name, cfg in SETTINGS.items():
        for impl in IMPLEMENTATIONS:
            if impl == "fused" and name != "adamw":
                continue
            settings = {**cfg.__dict__, "implementation": impl}
            built[(name, impl)] = build_optimizer(model, OptimizerConfig(**settings))
    return built


def timed(step: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock and process CPU milliseconds of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    step()
    return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3


def measure(model_name: str, cfg: ModelConfig, steps: int, warmup: int) -> list[dict]:
    torch.manual_seed(0)
    model = build_model(cfg)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opts = optimizers(model)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {key: [] for key in opts}
    order = list(opts)
    for round_ in range(warmup + steps):
        random.Random(round_).shuffle(order)  # no optimizer always follows the same one
        for key in order:
            ms = timed(opts[key].step)
            if round_ >= warmup:
                times[key].append(ms)
    num_params = sum(p.numel() for p in model.parameters())
    return [
        {
            "model": model_name,
            "params": num_params,
            "optimizer": name,
            "implementation": impl,
            "step_ms": round(statistics.median(t[0] for t in times[(name, impl)]), 2),
            "cpu_ms": round(statistics.median(t[1] for t in times[(name, impl)]), 2),
            "min_ms": round(min(t[0] for t in times[(name, impl)]), 2),
            "steps": steps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        }
        for name, impl in opts
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed rounds (median reported)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for model_name, cfg in models().items():
        for row in measure(model_name, cfg, args.steps, args.warmup):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
