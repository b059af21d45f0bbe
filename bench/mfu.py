"""Tokens/s, MFU and peak memory of a model preset, through the framework's own build.

Builds the job the way `kempnerforge train` does (load_config, init_runtime, build_session:
parallelism, activation checkpointing, compile, optimizer) from a preset in configs/model/
and the built-in corpus, then times `steps` optimizer steps of the real step body
(session.step_fn, then the optimizer and scheduler) after `warmup` untimed ones. Metrics
rows, eval and checkpoints are left out; bench/throughput.py measures what they add. On a
GPU the step runs in bf16 and MFU is reported against the device's dense peak; on CPU
MFU is null. Under torchrun every rank trains and the tokens/s is the whole job's.
Prints one JSON line.

    python bench/mfu.py --preset debug --seq-len 256 --batch-size 8
    python bench/mfu.py --preset 1b --seq-len 2048 --batch-size 4 --compile --ac selective
    torchrun --standalone --nproc_per_node=8 bench/mfu.py --preset 8b --fused-optimizer
    python bench/mfu.py --preset 1b --seq-len 4096 --batch-size 4 --compile --train.float8=true

A config the job refuses (train.float8 on a CPU, say) is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from kempnerforge.config.context_parallel import cp_ring
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import configure_logging
from kempnerforge.distributed.runtime import (
    init_runtime,
    rank_from_env,
    teardown_runtime,
    world_size_from_env,
)
from kempnerforge.metrics.mfu import peak_flops_per_sec
from kempnerforge.model.transformer import flops_per_token
from kempnerforge.training.build import build_session
from kempnerforge.training.preflight import preflight
from kempnerforge.training.session import TrainingSession

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--preset", default="debug", help="configs/model/<NAME>.toml, or a path")
    parser.add_argument("--seq-len", type=int, default=0, help="0: the preset's max_seq_len")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--ac", choices=("none", "full", "selective"), default="none")
    parser.add_argument(
        "--fused-optimizer",
        action="store_true",
        help="AdamW implementation 'fused' (else 'auto': fused where torch has the kernel)",
    )
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 autocast (GPU default)")
    precision.add_argument("--fp32", action="store_true", help="fp32 (CPU default)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args, overrides = parser.parse_known_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    return args, overrides


def preset_path(name: str) -> str:
    if os.path.exists(name):
        return name
    return os.path.join(REPO, "configs", "model", f"{name}.toml")


def job_overrides(args: argparse.Namespace, run_dir: str, on_gpu: bool) -> list[str]:
    """The bench's settings as `--section.field=value` overrides of the preset."""
    precision = "bf16" if args.bf16 or (on_gpu and not args.fp32) else "fp32"
    settings = [
        f"--train.batch_size={args.batch_size}",
        f"--train.max_steps={args.warmup + args.steps}",
        f"--train.mixed_precision={precision}",
        f"--train.compile={'true' if args.compile else 'false'}",
        f"--train.device={args.device}",
        f"--train.run_dir={run_dir}",
        "--train.sample_tokens=0",
        f"--distributed.activation_checkpointing={args.ac}",
        f"--optimizer.implementation={'fused' if args.fused_optimizer else 'auto'}",
        "--eval.interval=0",
        "--checkpoint.interval=0",
        "--metrics.progress=off",
    ]
    if args.seq_len:
        settings.append(f"--train.seq_len={args.seq_len}")
    return settings


def take_step(session: TrainingSession, step: int) -> float:
    """One optimizer step: the job's step body, then the update the loop would make."""
    result = session.step_fn(session, step)
    session.optimizer.step()
    session.scheduler.step()
    session.optimizer.zero_grad(set_to_none=True)
    return result.loss


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: torch.device) -> tuple[float, str]:
    """This rank's peak memory and what it measures."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30, "cuda_max_allocated"
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 2**20, "process_max_rss"


def job_max(value: float, device: torch.device) -> float:
    """The largest value over all ranks (the value itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def measure(args: argparse.Namespace, overrides: list[str], run_dir: str) -> dict | None:
    """Build the job, run it, and return the results (None on ranks other than 0)."""
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    settings = job_overrides(args, run_dir, on_gpu) + overrides  # the caller's win
    config = load_config(preset_path(args.preset), settings)
    world_size = world_size_from_env()
    config.validate(world_size)
    preflight(config)  # e.g. train.float8 where FP8 cannot run: one line, before any build
    runtime = init_runtime(config.distributed, config.train.device, cp_ring(config))
    try:
        session = build_session(config, runtime)
        device, tc = runtime.device, config.train
        session.model.train()
        if session.batches.has_data:
            session.batches.ensure_started()
        for step in range(args.warmup):
            take_step(session, step)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        synchronize(device)
        job_max(0.0, device)  # every rank starts the clock together
        started = time.perf_counter()
        loss = float("nan")
        for step in range(args.warmup, args.warmup + args.steps):
            loss = take_step(session, step)
        synchronize(device)
        seconds = job_max(time.perf_counter() - started, device)
        memory, memory_kind = peak_memory_gib(device)
        memory = job_max(memory, device)
        session.tracker.close()
    finally:
        teardown_runtime(runtime)
    if not runtime.is_main:
        return None
    tokens = tc.batch_size * tc.seq_len * tc.grad_accum_steps * runtime.dp_size * args.steps
    tokens_per_sec = tokens / seconds
    per_token = flops_per_token(config.model, tc.seq_len)
    peak = peak_flops_per_sec(device, tc.precision_on(device.type))
    return {
        "preset": args.preset,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": runtime.world_size,
        "threads_per_rank": torch.get_num_threads(),
        "precision": tc.precision_on(device.type),
        "compile": tc.compile,
        "float8": tc.float8,
        "ac": config.distributed.activation_checkpointing,
        "optimizer": f"{config.optimizer.name}/{config.optimizer.implementation}",
        "params": config.model.num_params(),
        "seq_len": tc.seq_len,
        "batch_size": tc.batch_size,
        "global_batch_size": tc.batch_size * tc.grad_accum_steps * runtime.dp_size,
        "warmup_steps": args.warmup,
        "steps": args.steps,
        "step_time_s": seconds / args.steps,
        "tokens_per_sec": tokens_per_sec,
        "tokens_per_sec_per_rank": tokens_per_sec / runtime.world_size,
        "flops_per_token": per_token,
        "peak_flops_per_sec": peak,
        "mfu": tokens_per_sec * per_token / (peak * runtime.world_size) if peak else None,
        "peak_memory_gib": memory,
        "memory": memory_kind,
        "last_loss": loss,
    }


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(argv)
    configure_logging(rank_from_env())
    with tempfile.TemporaryDirectory(prefix="bench-mfu-") as run_dir:
        try:
            result = measure(args, overrides, run_dir)
        except ConfigError as error:
            print(f"mfu.py: error: {error}", file=sys.stderr)
            return 2
    if result is not None:
        print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
