"""Tokens/s of one training step (forward with the loss, backward, AdamW) of each published
family's decoder options at the debug preset's size, against the plain Llama-style debug
model: the same width, depth, heads, batch and sequence, so the parameter counts differ
only by the families' own norm gains (a few hundred of 3.5M).

In one process, on the current default device; the families alternate within a round (a
drift in the machine's speed hits all alike) and the report gives each one's median
tokens/s over the rounds and its ratio to Llama's. Run alone on the machine.

    python bench/families.py                    # 5 rounds of 6 timed steps
    python bench/families.py --rounds 9 --steps 10
"""

from __future__ import annotations

import argparse
import statistics
import time
import tomllib
from pathlib import Path

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.heads import HeadLoss
from kempnerforge.model.transformer import Transformer

REPO = Path(__file__).parents[1]
FAMILIES = {
    "llama": {},
    "mistral": {"sliding_window": 64},
    "qwen3": {"qk_norm": "per_head"},
    "olmo2": {"qk_norm": "projection", "norm_placement": "post"},
    "gemma3": {
        **{"norm_placement": "sandwich", "zero_centered_norms": True, "qk_norm": "per_head"},
        **{"ffn_activation": "gelu_tanh", "embedding_multiplier": 16.0},
        **{"attention_scale_size": 48, "sliding_window": 64, "sliding_window_pattern": 2},
        **{"rope_local_theta": 10000.0, "rope_scaling": "linear", "rope_scaling_factor": 8.0},
    },
    "gpt_oss": {
        **{"attention_sinks": True, "attention_bias": True},
        **{"sliding_window": 64, "sliding_window_pattern": 2},
        **{"rope_scaling": "yarn", "rope_scaling_factor": 32.0},
        "rope_original_max_seq_len": 64,
    },
}
"""Each family's decoder options over the debug preset (Mistral: a window of a quarter of
the 256 positions; Qwen3 keeps the derived head size, so its parameters stay equal; Gemma
3 and GPT-OSS alternate windowed and global layers, as their 4-layer shrink can; GPT-OSS's
attention only: its experts are an MoE's, not a dense model's)."""


def debug_model_fields() -> dict:
    return tomllib.loads((REPO / "configs/model/debug.toml").read_text())["model"]


def step_time_s(model: Transformer, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """Wall time of one forward (loss from labels), backward and optimizer step."""
    start = time.perf_counter()
    out = model(ids[:, :-1], labels=ids[:, 1:])
    assert isinstance(out, HeadLoss)
    (out.loss_sum / out.token_losses.numel()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per round")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    runs = {}
    for name, options in FAMILIES.items():
        cfg = ModelConfig(**{**debug_model_fields(), **options})
        model = Transformer(cfg).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        runs[name] = (model, opt, cfg.num_params())
    ids = torch.randint(0, 259, (args.batch_size, args.seq_len + 1))
    for model, opt, _ in runs.values():
        step_time_s(model, opt, ids)  # warm-up: allocator and kernels' first use
    rates: dict[str, list[float]] = {name: [] for name in runs}
    tokens = args.batch_size * args.seq_len
    for _ in range(args.rounds):
        for name, (model, opt, _) in runs.items():
            seconds = sum(step_time_s(model, opt, ids) for _ in range(args.steps))
            rates[name].append(tokens * args.steps / seconds)
    base = statistics.median(rates["llama"])
    print(f"{'family':<8} {'params':>10} {'tokens/s':>10} {'vs llama':>9}")
    for name, (_, _, params) in runs.items():
        median = statistics.median(rates[name])
        print(f"{name:<8} {params:>10,} {median:>10,.0f} {median / base:>9.3f}")


if __name__ == "__main__":
    main()
