"""One attention layer over packed documents at seq 8192 on a GPU: SDPA's causal flash
kernel on whole rows, and packed documents (alone, and with a sliding window) through the
mask rules' kernel (train.attention_kernel = "auto": FlexAttention with a block mask,
compiled once) and through the dense (batch, 1, seq, seq) mask. Forward + backward
milliseconds and peak memory of each, the block mask's build time, and a pass/fail line:
the rules' outputs and gradients equal the dense mask's within bf16 rounding.

    python bench/gpu/attention.py [--dry-run]

--dry-run runs the same code on the CPU with tiny shapes in fp32 (where the rules' kernel
is the CPU's per-document one: FlexAttention has no CPU backward). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from kempnerforge.model.attention import MaskRule, attend, prepare_masks  # noqa: E402

GPU_SHAPE = {"batch": 2, "heads": 32, "kv_heads": 8, "seq": 8192, "head_dim": 128}
"""Llama-3 8B's attention (32 query, 8 key/value heads of 128) at 2 x 8192 tokens."""
DRY_SHAPE = {"batch": 2, "heads": 4, "kv_heads": 2, "seq": 512, "head_dim": 32}
DOC_LEN = 700
"""Mean document length; lengths are drawn from 1 to 2 * DOC_LEN, seeded."""
WINDOW = 4096
TOLERANCE = {torch.bfloat16: 2e-2, torch.float32: 1e-4}
"""Largest relative error (norm of the difference over the norm) of the rules' output and
gradients against the dense mask's: bf16 keeps about 3 significant digits; fp32 kernels
that sum in other orders agree to about 1e-6, far inside 1e-4."""


def packed_doc_ids(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """(batch, seq): each row cut into documents of 1 to 2 * DOC_LEN tokens."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(1, 2 * DOC_LEN, (), generator=gen)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack([r[:seq] for r in rows])


def timed(fn: Callable[[], torch.Tensor], grad: torch.Tensor, device: torch.device, reps: int):
    """(median ms of forward + backward over ``reps`` after two warm-up calls, the first
    call's seconds, which include any compilation, peak GiB of one call on a GPU)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    started = time.perf_counter()
    fn().backward(grad)
    sync()
    first_s = time.perf_counter() - started
    fn().backward(grad)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        sync()
        started = time.perf_counter()
        fn().backward(grad)
        sync()
        times.append((time.perf_counter() - started) * 1e3)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None
    return statistics.median(times), first_s, peak


def relative_errors(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[float]:
    pairs = zip(got, want, strict=True)
    return [
        float((a.detach().float() - b.detach().float()).norm() / b.float().norm()) for a, b in pairs
    ]


def measure(shape: dict, device: torch.device, dtype: torch.dtype, reps: int) -> dict:
    b, h, kv, s, d = (shape[k] for k in ("batch", "heads", "kv_heads", "seq", "head_dim"))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(b, n, s, d, generator=gen).to(device, dtype).requires_grad_()
        for n in (h, kv, kv)
    )
    grad = torch.randn(b, h, s, d, generator=gen).to(device, dtype)
    doc_ids = packed_doc_ids(b, s).to(device)
    window = min(WINDOW, s // 2)
    rules = {"packed": MaskRule(documents=True), "packed_window": MaskRule(True, window)}
    result: dict = {"ms": {}, "first_call_s": {}, "peak_memory_gib": {}, "mask_build_ms": {}}

    def record(name: str, fn: Callable[[], torch.Tensor]) -> None:
        ms, first, peak = timed(fn, grad, device, reps)
        result["ms"][name], result["first_call_s"][name] = round(ms, 2), round(first, 2)
        result["peak_memory_gib"][name] = None if peak is None else round(peak, 3)

    grouped = h != kv
    record(
        "causal_flash",
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped),
    )
    errors = {}
    for name, rule in rules.items():
        started = time.perf_counter()
        (mask,) = prepare_masks([rule], doc_ids, b, s, device)
        result["mask_build_ms"][name] = round((time.perf_counter() - started) * 1e3, 2)
        (dense,) = prepare_masks([rule], doc_ids, b, s, device, "dense")
        record(f"{name}_rules", lambda mask=mask: attend(q, k, v, mask))
        record(f"{name}_dense", lambda dense=dense: attend(q, k, v, dense))
        outs = []
        for prepared in (mask, dense):
            out = attend(q, k, v, prepared)
            outs.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
        errors[name] = dict(zip(("out", "dq", "dk", "dv"), relative_errors(*outs), strict=True))
    result["relative_errors"] = errors
    result["kernel"] = type(mask).__name__
    worst = max(e for errs in errors.values() for e in errs.values())
    result["status"] = "pass" if worst <= TOLERANCE[dtype] else "fail"
    result["tolerance"] = TOLERANCE[dtype]
    for name in rules:
        result[f"{name}_rules_over_dense_speed"] = round(
            result["ms"][f"{name}_dense"] / result["ms"][f"{name}_rules"], 2
        )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny, fp32")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    shape = GPU_SHAPE if cuda else DRY_SHAPE
    result = measure(shape, device, dtype, 2 if args.dry_run else args.reps)
    result |= {"shape": shape, "dtype": str(dtype).removeprefix("torch."), "doc_len": DOC_LEN}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
