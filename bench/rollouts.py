"""GRPO's rollout sampling speed: completions decoded through the training forward with its
key/value cache (training/objectives/sampling.py), tokens sampled per second.

One process, the model of a training config built and initialised from its seed (the speed
of decoding does not depend on what the weights have learnt, only on how many tokens each
completion runs to: stop tokens are off, so every completion runs max_new_tokens), random
prompts of --prompt-len tokens, each sampled --group times, --rows-per-forward rows a
forward (a rollout's train.batch_size):

    python bench/rollouts.py --config configs/train/debug.toml --prompts 16 --group 8 \
        --prompt-len 40 --max-new-tokens 32 --rounds 3

Prints one JSON line: the shape, each round's seconds and the median tokens/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kempnerforge.config.loader import load_config
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.objectives.sampling import Decoding, decode_completions


def measure(args: argparse.Namespace) -> dict:
    config = load_config(args.config, [])
    model = Transformer(config.model).eval()
    model.init_weights(seed=config.train.seed)
    generator = torch.Generator().manual_seed(0)
    vocab = config.model.vocab_size
    prompts = [
        torch.randint(1, vocab, (args.prompt_len,), generator=generator).tolist()
        for _ in range(args.prompts)
    ]
    rows = [prompt for prompt in prompts for _ in range(args.group)]
    decoding = Decoding(
        max_new_tokens=args.max_new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        stop_ids=frozenset(),
        pad_id=0,
        width=args.prompt_len + args.max_new_tokens,
        rows_per_forward=args.rows_per_forward,
    )
    seconds, tokens = [], 0
    for round_ in range(args.rounds):
        started = time.perf_counter()
        completions = decode_completions(
            model, rows, list(range(round_, round_ + len(rows))), decoding, torch.device("cpu"),
            None,
        )  # fmt: skip
        seconds.append(time.perf_counter() - started)
        tokens = sum(len(c) for c in completions)
    return {
        "config": args.config,
        "rows": len(rows),
        "rows_per_forward": args.rows_per_forward,
        "prompt_len": args.prompt_len,
        "tokens_per_round": tokens,
        "seconds": [round(s, 3) for s in seconds],
        "tokens_per_s": round(tokens / statistics.median(seconds), 1),
        "threads": torch.get_num_threads(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-len", type=int, default=40)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rows-per-forward", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    print(json.dumps(measure(parser.parse_args())))


if __name__ == "__main__":
    main()
