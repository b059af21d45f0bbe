"""The single-GPU paths, each run once and judged pass or fail: bench/gpu/suite.py runs
every check in its own process and records the JSON line it prints.

    python bench/gpu/checks.py NAME --work DIR [--dry-run]

Checks that train go through `kempnerforge train` (a subprocess, as a user runs it), on
CUDA, or on the CPU with the same code paths under --dry-run. A check prints one JSON
object: {"status": "pass" | "fail", ...what it saw}, or several such objects by name
when one run serves several checks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kempnerforge.core.metrics_file import read_rows
from kempnerforge.model.heads.head_loss import linear_cross_entropy

REPO = Path(__file__).resolve().parents[2]
TRAIN = REPO / "configs" / "train"
Result = dict[str, Any]


def device_overrides(dry_run: bool) -> list[str]:
    return ["--train.device=cpu"] if dry_run else ["--train.device=cuda"]


def quiet_run(run_dir: Path, steps: int) -> list[str]:
    """Overrides of a short run that logs every step and writes only what a check reads."""
    return [
        f"--train.run_dir={run_dir}",
        f"--train.max_steps={steps}",
        "--train.sample_tokens=0",
        "--metrics.log_interval=1",
        "--metrics.progress=off",
        "--eval.interval=0",
    ]


def kempnerforge(*args: str, timeout_s: float = 240, env: dict[str, str] | None = None):
    """Run the CLI; the finished process (its output captured)."""
    return subprocess.run(
        [sys.executable, "-m", "kempnerforge", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def step_losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss in run_dir/metrics.jsonl; a step logged twice (a resumed run
    repeats the steps after its checkpoint) keeps its last row."""
    rows = read_rows(run_dir / "metrics.jsonl")
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r and "event" not in r}


def failed(what: str, done: subprocess.CompletedProcess | None = None) -> Result:
    tail = "" if done is None else f" (exit {done.returncode}): {done.stderr.strip()[-600:]}"
    return {"status": "fail", "reason": what + tail}


def trains(config: str, run_dir: Path, steps: int, dry_run: bool, *extra: str) -> Result:
    """A run of ``config`` that exits 0 with finite losses."""
    done = kempnerforge(
        "train", str(TRAIN / config), *device_overrides(dry_run), *quiet_run(run_dir, steps), *extra
    )
    if done.returncode != 0:
        return failed("the run failed", done)
    losses = step_losses(run_dir)
    if len(losses) != steps or not all(math.isfinite(x) for x in losses.values()):
        return failed(f"expected {steps} finite losses, got {sorted(losses.items())}")
    return {"status": "pass", "first_loss": losses[1], "last_loss": losses[steps]}


# --- the checks --------------------------------------------------------------------------

# 'auto' expert compute takes torch._grouped_mm for bf16 rows on a GPU of compute capability
# 9.0+ (fp32 on CPU) when every inner width is a multiple of 16 bytes, and the padded
# batched matmul otherwise: an expert width of 130 is aligned in neither dtype.
MOE_CASES = {
    "moe_grouped_softmax": [],
    "moe_grouped_sigmoid": ["--model.moe_router=sigmoid", "--model.moe_aux_loss_weight=0"],
    "moe_padded_softmax": ["--model.moe_expert_hidden_dim=130"],
    "moe_padded_sigmoid": [
        "--model.moe_expert_hidden_dim=130",
        "--model.moe_router=sigmoid",
        "--model.moe_aux_loss_weight=0",
    ],
}


def check_moe(work: Path, dry_run: bool) -> Result:
    """The MoE debug config through `kempnerforge train`, grouped and padded expert compute
    under the softmax and sigmoid routers: each case trains with finite losses."""
    steps = 4 if dry_run else 20
    return {
        name: trains("debug_moe.toml", work / name, steps, dry_run, *extra)
        for name, extra in MOE_CASES.items()
    }


# The decoder options of the open families (docs/interop.md), each on the debug config
# (an MoE family on the MoE one).
FAMILY_CASES = {
    "qwen3": ["--model.qk_norm=per_head", "--model.head_size=64", "--model.n_kv_heads=2"],
    "mistral": ["--model.sliding_window=128", "--model.n_kv_heads=2"],
    "olmo2": ["--model.qk_norm=projection", "--model.norm_placement=post"],
    "gemma3": [
        *("--model.norm_placement=sandwich", "--model.zero_centered_norms=true"),
        *("--model.qk_norm=per_head", "--model.ffn_activation=gelu_tanh"),
        *("--model.embedding_multiplier=16.0", "--model.attention_scale_size=48"),
        *("--model.sliding_window=128", "--model.sliding_window_pattern=2"),
        *("--model.rope_local_theta=10000", "--model.rope_scaling=linear"),
        "--model.rope_scaling_factor=8",
    ],
    # Sinks through FlexAttention's log-sum-exp (causal layers too), biases, YaRN, the
    # biased clamped experts through the grouped matmul.
    "gpt_oss": [
        *("--model.attention_sinks=true", "--model.attention_bias=true"),
        *("--model.head_size=64", "--model.n_kv_heads=2"),
        *("--model.sliding_window=128", "--model.sliding_window_pattern=2"),
        *("--model.rope_scaling=yarn", "--model.rope_scaling_factor=32"),
        "--model.rope_original_max_seq_len=4096",
        *("--model.moe_router_bias=true", "--model.moe_expert_bias=true"),
        "--model.moe_activation=clamped_swiglu",
    ],
    # Latent attention (values narrower than the query/key heads, through SDPA and
    # FlexAttention as they are), YaRN with DeepSeek's mscales, grouped sigmoid routing
    # with routed scaling and a shared expert after a dense first layer.
    "deepseek_v3": [
        *("--model.mla_kv_rank=128", "--model.mla_q_rank=192"),
        *("--model.mla_nope_head_size=64", "--model.mla_rope_head_size=32"),
        "--model.mla_value_head_size=64",
        *("--model.rope_scaling=yarn", "--model.rope_scaling_factor=32"),
        "--model.rope_original_max_seq_len=4096",
        *("--model.rope_yarn_mscale=1.0", "--model.rope_yarn_mscale_all_dim=1.0"),
        *("--model.moe_router=sigmoid", "--model.moe_num_groups=4"),
        *("--model.moe_top_groups=2", "--model.moe_routed_scaling=2.5"),
        *("--model.moe_shared_experts=1", "--model.moe_first_dense_layers=1"),
    ],
}
MOE_FAMILIES = {"gpt_oss", "deepseek_v3"}
"""The families whose every layer is MoE: they start from debug_moe.toml."""


def check_families(work: Path, dry_run: bool) -> Result:
    """Each open family's decoder options through `kempnerforge train` (query and key norms
    per head or over the projection, norms after each sublayer, a sliding window on every
    layer, Gemma 3's sandwich of zero-centred norms with GeGLU and a RoPE per kind of
    layer, GPT-OSS's sinks, biases, YaRN and clamped experts, DeepSeek-V3's latent
    attention and grouped routing): each case trains with finite losses."""
    steps = 4 if dry_run else 20
    return {
        name: trains(
            "debug_moe.toml" if name in MOE_FAMILIES else "debug.toml",
            work / name,
            steps,
            dry_run,
            *extra,
        )
        for name, extra in FAMILY_CASES.items()
    }


def check_head_loss(work: Path, dry_run: bool) -> Result:
    """The chunked head loss against whole logits with a 128k vocabulary under bf16
    autocast: the same loss and gradients up to bf16 rounding."""
    del work
    device = torch.device("cpu" if dry_run else "cuda")
    vocab, tokens, dim = (4096, 256, 64) if dry_run else (128256, 8192, 2048)
    chunk_tokens = 64 if dry_run else 2048  # several chunks either way
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.randn(tokens, dim, device=device, generator=gen)
    weight = torch.randn(vocab, dim, device=device, generator=gen) * dim**-0.5
    labels = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
    results = []
    for chunk in (chunk_tokens, 0):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = linear_cross_entropy(h, w, labels, chunk_tokens=chunk, z_loss_weight=0.0)
        out.loss_sum.backward()
        results.append((out.loss_sum.item() / tokens, h.grad, w.grad))
    (chunked, gh, gw), (whole, rh, rw) = results
    assert gh is not None and gw is not None and rh is not None and rw is not None

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    errors = {"loss": abs(chunked - whole) / whole, "grad_hidden": rel(gh, rh)}
    errors["grad_weight"] = rel(gw, rw)
    ok = all(e < 2e-2 for e in errors.values())  # bf16 keeps about 3 significant digits
    return {
        "status": "pass" if ok else "fail",
        "vocab": vocab,
        "tokens": tokens,
        "loss_chunked": chunked,
        "loss_whole": whole,
        "relative_errors": errors,
    }


def check_checkpoint(work: Path, dry_run: bool) -> Result:
    """Async checkpoints of the model's tensors, a SIGKILL while the last save is held
    open, and a resume whose losses equal the uninterrupted run's bitwise (deterministic
    mode); then `kempnerforge generate` on that checkpoint, with and without the KV cache
    (greedy: the same text)."""
    steps, every = (8, 4) if dry_run else (20, 10)
    common = [
        *device_overrides(dry_run),
        "--train.deterministic=true",
        f"--checkpoint.interval={every}",
        "--checkpoint.async_mode=async",
    ]
    config = str(TRAIN / "debug.toml")
    whole = work / "uninterrupted"
    done = kempnerforge("train", config, *common, *quiet_run(whole, steps))
    if done.returncode != 0:
        return {"async_checkpoint_kill_resume": failed("the uninterrupted run failed", done)}
    killed = work / "killed"
    # The last save is held before its commit marker, so the kill lands mid-save.
    hold = {
        "KEMPNERFORGE_FAULT_SAVE_DELAY_S": "600",
        "KEMPNERFORGE_FAULT_SAVE_DELAY_FROM_STEP": str(steps),
    }
    result = kill_mid_save(config, killed, [*common, *quiet_run(killed, steps)], hold, steps)
    if result is None:
        done = kempnerforge("train", config, *common, *quiet_run(killed, steps))
        expected, got = step_losses(whole), step_losses(killed)
        if done.returncode != 0:
            result = failed("the resumed run failed", done)
        elif got != expected:
            result = failed(f"losses differ: uninterrupted {expected}, resumed {got}")
        else:
            resumes = [r for r in read_rows(killed / "metrics.jsonl") if r.get("event") == "resume"]
            result = {
                "status": "pass",
                "resumed_at": [r["step"] for r in resumes],
                "losses_equal_bitwise": True,
            }
    return {"async_checkpoint_kill_resume": result, "generate_kv_cache": generate(whole, steps)}


def kill_mid_save(
    config: str, run_dir: Path, args: list[str], env: dict[str, str], steps: int
) -> Result | None:
    """Start a run, SIGKILL it once its last save is written but held; None when killed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kempnerforge", "train", config, *args],
        cwd=REPO,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    held = run_dir / "checkpoints" / f"step_{steps}.tmp" / ".metadata"
    deadline = time.monotonic() + 240
    try:
        while not held.is_file():
            if proc.poll() is not None:
                return failed(f"the run ended (exit {proc.returncode}) before its last save")
            if time.monotonic() > deadline:
                return failed("the run never reached its last save")
            time.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        return None
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def generate(run_dir: Path, steps: int) -> Result:
    """Greedy continuations with and without the KV cache; both the same text."""
    checkpoint = str(run_dir / "checkpoints" / f"step_{steps}")
    texts = []
    for cache in ([], ["--no-cache"]):
        done = kempnerforge(
            "generate",
            "--checkpoint",
            checkpoint,
            "--prompt",
            "def ",
            "--temperature",
            "0",
            "--max-new-tokens",
            "32",
            *cache,
        )
        if done.returncode != 0:
            return failed("generate failed", done)
        texts.append(done.stdout)
    if texts[0] != texts[1]:
        return failed(f"the KV cache changed the greedy text: {texts[0]!r} vs {texts[1]!r}")
    return {"status": "pass", "text": texts[0][-200:]}


def check_vlm(work: Path, dry_run: bool) -> Result:
    """The VLM debug config with the gated cross-attention arch trains."""
    return trains(
        "vlm_debug.toml",
        work / "vlm",
        4 if dry_run else 20,
        dry_run,
        "--vlm.arch=cross_attention",
        "--vlm.cross_attention_every_n_layers=2",
    )


def check_compile_ac(work: Path, dry_run: bool) -> Result:
    """Compiled blocks under full activation checkpointing against eager without it: the
    same losses up to the tolerance of bf16 arithmetic (fp32 on the CPU)."""
    steps = 4 if dry_run else 20
    runs = {}
    for name, extra in (
        ("eager", []),
        ("compiled_ac", ["--train.compile=true", "--distributed.activation_checkpointing=full"]),
    ):
        result = trains("debug.toml", work / name, steps, dry_run, *extra)
        if result["status"] != "pass":
            return failed(f"the {name} run failed: {result['reason']}")
        runs[name] = step_losses(work / name)
    worst = max(abs(runs["eager"][s] - runs["compiled_ac"][s]) for s in runs["eager"])
    tolerance = 1e-3 if dry_run else 0.05
    return {
        "status": "pass" if worst <= tolerance else "fail",
        "max_abs_loss_difference": worst,
        "tolerance": tolerance,
        "steps": steps,
    }


CURVE_TOLERANCE = 0.05
"""Largest mean absolute loss difference (nats) between FP8 and bf16 over the last
quarter of the curve: about 1% of the loss there, and several times the spread of two
bf16 runs that differ only in their kernels' order of summation."""


def check_float8_curve(work: Path, dry_run: bool) -> Result:
    """The 125M preset for 200 steps in bf16 and with train.float8 (eager, same seed and
    data): the FP8 loss curve within CURVE_TOLERANCE of bf16's over its last quarter.
    Where FP8 is refused (the CPU, an older GPU, no torchao) the refusal is the result."""
    steps, preset, seq = (6, "debug", 64) if dry_run else (200, "125m", 1024)
    config = str(REPO / "configs" / "model" / f"{preset}.toml")
    common = [
        *device_overrides(dry_run),
        "--train.mixed_precision=bf16",
        "--train.batch_size=8",
        f"--train.seq_len={seq}",
        "--checkpoint.interval=0",
    ]
    curves = {}
    # FP8 first: where it is refused, the refusal comes at validation, before a bf16 run
    # that would then compare with nothing.
    for name, extra in (("fp8", ["--train.float8=true"]), ("bf16", [])):
        done = kempnerforge(
            "train", config, *common, *quiet_run(work / name, steps), *extra, timeout_s=400
        )
        refusal = [line for line in done.stderr.splitlines() if "train.float8 = " in line]
        if done.returncode == 2 and refusal:
            return {"status": "skipped", "reason": refusal[-1]}
        if done.returncode != 0:
            return failed(f"the {name} run failed", done)
        curves[name] = [step_losses(work / name)[s] for s in range(1, steps + 1)]
    tail = max(1, steps // 4)
    gaps = [abs(a - b) for a, b in zip(curves["fp8"][-tail:], curves["bf16"][-tail:], strict=True)]
    gap = sum(gaps) / tail
    return {
        "status": "pass" if gap <= CURVE_TOLERANCE else "fail",
        "steps": steps,
        "preset": preset,
        "seq_len": seq,
        "mean_abs_difference_last_quarter": gap,
        "tolerance": CURVE_TOLERANCE,
        "final_loss_bf16": curves["bf16"][-1],
        "final_loss_fp8": curves["fp8"][-1],
        "curves": {k: [round(x, 4) for x in v] for k, v in curves.items()},
    }


def check_pytest_gpu(work: Path, dry_run: bool) -> Result:
    """The `pytest -m gpu` set; on a machine without CUDA every test skips itself.

    Only the files that hold gpu tests are collected: the others may import optional
    packages (an extra the GPU machine lacks) that the gpu tests never need.
    """
    del dry_run
    files = sorted(
        str(path.relative_to(REPO))
        for path in (REPO / "tests").rglob("test_*.py")
        if "pytest.mark.gpu" in path.read_text()
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "gpu",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--basetemp={work / 'pytest'}",
            *files,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = (done.stdout.strip().splitlines() or [""])[-1]
    passed = done.returncode == 0 and " passed" in summary and " failed" not in summary
    skipped_only = done.returncode == 0 and " passed" not in summary
    status = "pass" if passed else ("skipped" if skipped_only else "fail")
    out: Result = {"status": status, "summary": summary}
    if status == "fail":
        out["reason"] = done.stdout.strip()[-1500:]
    return out


CHECKS: dict[str, Callable[[Path, bool], Result]] = {
    "moe": check_moe,
    "families": check_families,
    "head_loss": check_head_loss,
    "checkpoint": check_checkpoint,
    "vlm": check_vlm,
    "compile_ac": check_compile_ac,
    "float8_curve": check_float8_curve,
    "pytest_gpu": check_pytest_gpu,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("name", choices=sorted(CHECKS))
    parser.add_argument("--work", required=True, help="a scratch directory for the runs")
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, tiny shapes")
    args = parser.parse_args(argv)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{args.name}-", dir=args.work))  # runs start afresh
    print(json.dumps(CHECKS[args.name](work, args.dry_run)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
