"""Memory of fine-tuning the 125m preset with low-rank adapters ([lora]) against full
fine-tuning: optimizer state, gradients and the step's peak.

Each mode runs in a fresh process: the 125m model (configs/model/125m.toml) built as the
trainer builds it (adapters put on before the weights are drawn, the base then frozen),
AdamW from the optimizer section's defaults, and ``--steps`` optimizer steps on random
tokens (batch ``--batch`` x ``--seq``, fp32 on the CPU). Reported per mode:

- trainable and frozen parameters;
- optimizer state: the bytes of every tensor AdamW holds after the steps (its moments and
  step counts), the figure [lora] shrinks most;
- gradients: the bytes of the .grad tensors after a backward;
- peak: the increase of the process's peak resident set (getrusage ru_maxrss) over its
  value before the first step, with the model built and resident; it counts activations,
  gradients, optimizer state and allocator slack at the step's worst moment.

    python bench/lora_memory.py [--rank 16] [--steps 3] [--batch 4] [--seq 256]

Prints one JSON line: each mode's figures and the ratios full / lora.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from kempnerforge.config.loader import load_config
from kempnerforge.model.lora import add_adapters, freeze_base
from kempnerforge.model.meta import on_meta
from kempnerforge.model.transformer import Transformer
from kempnerforge.optim.optimizer import build_optimizer

PRESET = "configs/model/125m.toml"


def rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def measure(mode: str, rank: int, steps: int, batch: int, seq: int) -> dict:
    overrides = [f"--train.seq_len={seq}", f"--train.batch_size={batch}"]
    if mode == "lora":
        overrides.append(f"--lora.rank={rank}")
    config = load_config(PRESET, overrides)
    with on_meta():
        model = Transformer(config.model)
        add_adapters(model, config.lora)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    if mode == "lora":
        trainable, frozen = freeze_base(model)
    else:
        trainable, frozen = sum(p.numel() for p in model.parameters()), 0
    optimizer = build_optimizer(model, config.optimizer)
    generator = torch.Generator().manual_seed(0)
    before = rss_bytes()
    grads = 0
    for _ in range(steps):
        ids = torch.randint(0, config.model.vocab_size, (batch, seq + 1), generator=generator)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        grads = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = tensor_bytes(v for s in optimizer.state.values() for v in s.values())
    return {
        "trainable_params": trainable,
        "frozen_params": frozen,
        "optimizer_state_bytes": state,
        "grad_bytes": grads,
        "peak_increase_bytes": rss_bytes() - before,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--mode", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:  # one measurement, in this fresh process
        print(json.dumps(measure(args.mode, args.rank, args.steps, args.batch, args.seq)))
        return
    result: dict = {"preset": PRESET, "rank": args.rank, "steps": args.steps}
    result["tokens_per_step"] = args.batch * args.seq
    for mode in ("full", "lora"):
        argv = [sys.executable, __file__, "--mode", mode]
        argv += [f"--rank={args.rank}", f"--steps={args.steps}"]
        argv += [f"--batch={args.batch}", f"--seq={args.seq}"]
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        result[mode] = json.loads(out.strip().splitlines()[-1])
    for key in ("optimizer_state_bytes", "grad_bytes", "peak_increase_bytes"):
        lora = max(1, result["lora"][key])
        result[f"{key}_full_over_lora"] = round(result["full"][key] / lora, 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
