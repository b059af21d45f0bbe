"""A hand-written PyTorch GPU training loop: the baseline bench/gpu/suite.py measures
kempnerforge's tokens/s against, at the same model shape, batch and sequence length.

Written the way a practitioner writes a fast single-GPU loop, in plain PyTorch and
importing nothing from kempnerforge: the Llama module of bench/bare_loop.py (grouped-query
heads through SDPA, optionally a tied head), built directly on the device, bf16 autocast,
`torch.compile` (each block, or the whole model and its loss), `torch.optim.AdamW(fused=True)`,
gradient clipping at 1.0, `zero_grad(set_to_none=True)`, and one host read of the loss at
the end of the timed steps. No FSDP: one process holds the whole model. Batches are random
token ids (the arithmetic does not depend on them), made on the host and copied each step.

Prints one JSON line: tokens_per_sec (the timed steps after `--warmup` untimed ones, which
include the compilation), step_time_s, peak_memory_gib (CUDA's allocator peak over the
timed steps; the process's peak resident memory on the CPU), params, first and last loss.

    python bench/gpu/hand_loop.py --vocab 128256 --dim 2048 --n-layers 16 --n-heads 32 \\
        --n-kv-heads 8 --ffn-hidden 8192 --tie-embeddings --seq-len 4096 --batch-size 4
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bare_loop import Llama, add_model_arguments  # noqa: E402  (bench/, beside this folder)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    add_model_arguments(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument(
        "--compile",
        choices=("none", "blocks", "model"),
        default="blocks",
        help="torch.compile each block, or the whole model with its loss, or nothing",
    )
    p.add_argument("--compile-backend", default="inductor", help="'aot_eager' for quick tests")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    a.sdpa_gqa = True
    return a


def device_of(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    device = device_of(a.device)
    torch.manual_seed(a.seed)
    with torch.device(device):
        model = Llama(a)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    bf16 = device.type == "cuda"

    def loss_of(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    forward = loss_of
    if a.compile == "blocks":
        for block in model.blocks:
            block.compile(backend=a.compile_backend)
    elif a.compile == "model":
        forward = torch.compile(loss_of, backend=a.compile_backend)

    def step() -> torch.Tensor:
        window = torch.randint(0, a.vocab, (a.batch_size, a.seq_len + 1))
        if device.type == "cuda":
            window = window.pin_memory()
        window = window.to(device, non_blocking=True)
        loss = forward(window[:, :-1], window[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    first = step()
    for _ in range(a.warmup - 1):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    last = first
    for _ in range(a.steps):
        last = step()
    last_loss = last.item()  # the one host read: it waits for the last step
    seconds = time.perf_counter() - started
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "compile": a.compile,
                "precision": "bf16" if bf16 else "fp32",
                "optimizer": "adamw/fused",
                "params": params,
                "seq_len": a.seq_len,
                "batch_size": a.batch_size,
                "warmup_steps": a.warmup,
                "steps": a.steps,
                "step_time_s": seconds / a.steps,
                "tokens_per_sec": a.steps * a.batch_size * a.seq_len / seconds,
                "peak_memory_gib": peak_memory_gib(device),
                "first_loss": first.item(),
                "last_loss": last_loss,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
