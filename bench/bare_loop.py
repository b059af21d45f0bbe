"""A bare PyTorch training loop of the debug model: the baseline for bench/throughput.py.

Same model class and shape, batch, optimizer (AdamW, same groups and hyperparameters),
LR schedule and clipping as configs/train/debug.toml, with none of the framework around
it: random windows straight from the prepared token file. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
import torch.nn.functional as F

from kempnerforge.config.loader import load_config
from kempnerforge.data.builtin import builtin_corpus, default_cache_dir
from kempnerforge.data.tokenizer import ByteTokenizer
from kempnerforge.model import build_model
from kempnerforge.training.optimizer import build_optimizer
from kempnerforge.training.scheduler import build_scheduler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out of timing")
    args = parser.parse_args()
    config = load_config(args.config)
    tc = config.train
    train_dir, _ = builtin_corpus(
        default_cache_dir(), ByteTokenizer(), config.data.builtin_eval_fraction
    )
    tokens = np.memmap(f"{train_dir}/tokens.bin", dtype=np.uint16, mode="r")
    torch.manual_seed(tc.seed)
    model = build_model(config.model)
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_scheduler(optimizer, config.scheduler, args.steps)
    rng = np.random.default_rng(tc.seed)
    stamps = []
    for _ in range(args.steps):
        starts = rng.integers(0, len(tokens) - tc.seq_len - 1, size=tc.batch_size)
        window = torch.from_numpy(
            np.stack([tokens[s : s + tc.seq_len + 1] for s in starts]).astype(np.int64)
        )
        logits = model(window[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip_norm, foreach=True)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        stamps.append(time.perf_counter())
    timed = args.steps - args.skip
    seconds = stamps[-1] - stamps[args.skip - 1]
    print(json.dumps({"tokens_per_sec": timed * tc.batch_size * tc.seq_len / seconds}))


if __name__ == "__main__":
    main()
