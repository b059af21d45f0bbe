"""Decoding speed: generate with the KV cache against re-running the whole sequence for
every token (generate(..., use_cache=False)), on a model of the debug shape or larger.

Both decode greedily from the same prompt with the same random weights and produce the
same tokens (checked); they alternate in each round and the medians over the rounds are
printed. Run alone on the machine.

    python bench/generate.py
    python bench/generate.py --layers 12 --dim 768 --new-tokens 256 --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.model import build_model
from kempnerforge.model.generation.generate import generate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    cfg = ModelConfig(
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        vocab_size=259,
        max_seq_len=args.prompt_tokens + args.new_tokens,
    )
    torch.manual_seed(0)
    with torch.device(args.device):
        model = build_model(cfg)
    prompt = torch.randint(0, 256, (args.prompt_tokens,)).tolist()
    times: dict[str, list[float]] = {"cache": [], "no cache": []}
    outputs: dict[str, list[int]] = {}
    generate(model, prompt, 4, temperature=0.0)  # warm-up
    for _ in range(args.rounds):
        for name, use_cache in (("cache", True), ("no cache", False)):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = generate(model, prompt, args.new_tokens, temperature=0.0, use_cache=use_cache)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            outputs[name] = out
    if outputs["cache"] != outputs["no cache"]:
        raise SystemExit("the cached and uncached greedy outputs differ")
    print(
        f"{cfg.num_params() / 1e6:.1f}M parameters, {args.prompt_tokens}-token prompt, "
        f"{args.new_tokens} new tokens, {args.device}, medians of {args.rounds} rounds"
    )
    base = statistics.median(times["no cache"])
    for name, values in times.items():
        seconds = statistics.median(values)
        print(f"{name:9} {args.new_tokens / seconds:9.1f} tok/s   x{base / seconds:.2f}")


if __name__ == "__main__":
    main()
