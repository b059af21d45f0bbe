"""Every GPU figure of docs/performance.md in one time-boxed run, written as JSON.

    bench/gpu/run.sh [--dry-run] [--budget-s 480] [--only NAME,NAME]

Parts run in priority order, each in its own process with a timeout: the MFU runs of
bench/mfu.py (1B preset and the Llama-3-8B shape, compiled and eager), the hand-written
loop (bench/gpu/hand_loop.py) at the 1B shape, the single-GPU path checks
(bench/gpu/checks.py, several at once since none of them is timed) and the FP8 runs. A
part that would start after --budget-s is skipped, one still running at --deadline-s is
stopped; either way it is recorded with the reason, never ending the run. results.json is
rewritten after every part, so whatever finished is there even if the whole command is
killed. --dry-run runs every part on the CPU with tiny shapes: the same code paths and
JSON keys, minus CUDA (FP8 parts then record the one-line refusal as 'skipped').
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from bench.gpu.report import summarize  # noqa: E402
from kempnerforge.config.loader import load_config  # noqa: E402
from kempnerforge.config.model import ModelConfig  # noqa: E402

PY = sys.executable


@dataclass(frozen=True)
class Shape:
    """A model preset and the batch it is measured at."""

    preset: str
    seq_len: int
    batch_size: int
    warmup: int
    steps: int
    overrides: tuple[str, ...] = ()


GPU_SHAPES = {
    "1b": Shape("1b", 4096, 4, 3, 10),
    "8b": Shape("8b", 4096, 1, 2, 4),  # configs/model/8b.toml: the Llama-3-8B shape
}
DRY_SHAPES = {
    "1b": Shape("debug", 64, 2, 1, 2, ("--model.n_layers=2",)),
    "8b": Shape("debug", 64, 1, 1, 2, ("--model.n_layers=2", "--model.dim=128")),
}


@dataclass(frozen=True)
class Part:
    """One process of the run: its command, and what the budget plans for it."""

    name: str
    group: str
    """'device', 'mfu', 'hand_written', 'float8' or 'checks' (run several at once)."""
    command: list[str]
    estimate_s: float
    """Wall-clock seconds it takes on an H200, start-up and compilation included."""
    timeout_s: float = 300


@dataclass
class Run:
    """The run's state: where it writes, its clock, and the results so far."""

    out: Path
    work: Path
    dry_run: bool
    budget_s: float
    deadline_s: float
    started: float = field(default_factory=time.monotonic)
    results: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def record(self, name: str, group: str, result: dict[str, Any]) -> None:
        """Store a part's result and rewrite results.json (atomically)."""
        with self.lock:
            self.results.setdefault(group, {})[name] = result
            self.results["summary"] = summarize(self.results)
            self.results["meta"]["elapsed_s"] = round(self.elapsed(), 1)
            tmp = self.out / "results.json.tmp"
            tmp.write_text(json.dumps(self.results, indent=1, sort_keys=True) + "\n")
            os.replace(tmp, self.out / "results.json")


# --- the parts -----------------------------------------------------------------------------


def preset_model(shape: Shape) -> ModelConfig:
    return load_config(
        str(REPO / "configs" / "model" / f"{shape.preset}.toml"), list(shape.overrides)
    ).model


def mfu_part(
    name: str,
    shape: Shape,
    dry_run: bool,
    estimate_s: float,
    *,
    compile: bool,
    ac: str,
    float8: bool = False,
) -> Part:
    command = [
        PY,
        str(REPO / "bench" / "mfu.py"),
        f"--preset={shape.preset}",
        f"--seq-len={shape.seq_len}",
        f"--batch-size={shape.batch_size}",
        f"--steps={shape.steps}",
        f"--warmup={shape.warmup}",
        "--fused-optimizer",
        f"--ac={ac}",
        "--device=cpu" if dry_run else "--device=cuda",
        # Whole-row causal attention, as in the hand-written loop (no document mask).
        "--data.document_masking=false",
        *shape.overrides,
    ]
    if compile:
        command.append("--compile")
    if float8:
        command.append("--train.float8=true")
    group = "float8" if float8 else "mfu"
    return Part(name, group, command, estimate_s, timeout_s=300)


def hand_args(model: ModelConfig) -> list[str]:
    """bench/gpu/hand_loop.py's shape arguments for the same model as ``model``."""
    args = [
        f"--vocab={model.vocab_size}",
        f"--dim={model.dim}",
        f"--n-layers={model.n_layers}",
        f"--n-heads={model.n_heads}",
        f"--n-kv-heads={model.kv_heads}",
        f"--ffn-hidden={model.hidden_dim}",
        f"--rope-theta={model.rope_theta}",
        f"--norm-eps={model.norm_eps}",
    ]
    return args + (["--tie-embeddings"] if model.tie_embeddings else [])


def hand_part(name: str, shape: Shape, dry_run: bool, estimate_s: float, compile: str) -> Part:
    command = [
        PY,
        str(REPO / "bench" / "gpu" / "hand_loop.py"),
        *hand_args(preset_model(shape)),
        f"--seq-len={shape.seq_len}",
        f"--batch-size={shape.batch_size}",
        f"--steps={shape.steps}",
        f"--warmup={shape.warmup}",
        f"--compile={compile}",
        "--device=cpu" if dry_run else "--device=cuda",
    ]
    if dry_run and compile != "none":
        # The dry run checks the loop and what the compiler traces; the CPU's code generator
        # (a C++ build per graph, most of the dry run's time) is not the GPU's anyway.
        command.append("--compile-backend=aot_eager")
    return Part(name, "hand_written", command, estimate_s, timeout_s=300)


def check_part(name: str, run: Run, estimate_s: float, timeout_s: float = 300) -> Part:
    command = [PY, str(REPO / "bench" / "gpu" / "checks.py"), name, f"--work={run.work}"]
    return Part(
        name, "checks", command + (["--dry-run"] if run.dry_run else []), estimate_s, timeout_s
    )


def attention_part(run: Run, estimate_s: float) -> Part:
    """bench/gpu/attention.py: one attention layer over packed documents at seq 8192, the
    rules' kernel (FlexAttention) against the dense mask and the causal flash kernel."""
    command = [PY, str(REPO / "bench" / "gpu" / "attention.py")]
    return Part(
        "attention_packed", "checks", command + (["--dry-run"] if run.dry_run else []), estimate_s
    )


MATMUL_PEAK = (
    "import json,time,torch\n"
    "cuda=torch.cuda.is_available(); d='cuda' if cuda else 'cpu'\n"
    "n,t=(8192,torch.bfloat16) if cuda else (512,torch.float32)\n"
    "a,b=(torch.randn(n,n,device=d,dtype=t) for _ in range(2))\n"
    "sync=torch.cuda.synchronize if cuda else (lambda:None)\n"
    "[a@b for _ in range(3)]; sync(); s=time.perf_counter()\n"
    "[a@b for _ in range(20)]; sync(); e=time.perf_counter()-s\n"
    "print(json.dumps({'n':n,'dtype':str(t),'tflops':20*2*n**3/e/1e12}))\n"
)


def plan(run: Run) -> list[Part | list[Part]]:
    """The parts in priority order; a list is a group run several at once."""
    shapes, dry = (DRY_SHAPES if run.dry_run else GPU_SHAPES), run.dry_run
    one, eight = shapes["1b"], shapes["8b"]
    return [
        Part("matmul_peak", "device", [PY, "-c", MATMUL_PEAK], 15, 60),
        mfu_part("1b_compiled", one, dry, 75, compile=True, ac="none"),
        hand_part("1b_compiled_blocks", one, dry, 60, "blocks"),
        mfu_part("8b_compiled_selective_ac", eight, dry, 120, compile=True, ac="selective"),
        [
            check_part("moe", run, 60),
            check_part("families", run, 45),
            check_part("head_loss", run, 20),
            check_part("checkpoint", run, 70),
            check_part("vlm", run, 25),
            check_part("compile_ac", run, 60),
            check_part("float8_curve", run, 70),
            check_part("pytest_gpu", run, 150, timeout_s=420),
        ],
        attention_part(run, 120),  # alone: it times kernels
        mfu_part("1b_compiled_fp8", one, dry, 80, compile=True, ac="none", float8=True),
        mfu_part("1b_eager", one, dry, 35, compile=False, ac="none"),
        mfu_part(
            "8b_compiled_selective_ac_fp8",
            eight,
            dry,
            130,
            compile=True,
            ac="selective",
            float8=True,
        ),
        mfu_part("8b_eager_full_ac", eight, dry, 60, compile=False, ac="full"),
        mfu_part("8b_compiled_full_ac", eight, dry, 110, compile=True, ac="full"),
        hand_part("1b_compiled_model", one, dry, 100, "model"),
    ]


# --- running them --------------------------------------------------------------------------


def execute(part: Part, run: Run) -> None:
    """Run one part (or skip it for time) and record what it gave."""
    left = run.budget_s - run.elapsed()
    scale = 1.0 if not run.dry_run else 0.0  # the CPU's tiny shapes are not budgeted
    if part.estimate_s * scale > left:
        run.record(
            part.name,
            part.group,
            {
                "status": "skipped",
                "reason": (
                    f"not started: {max(left, 0):.0f} s of the {run.budget_s:.0f} s budget left, "
                    f"it needs about {part.estimate_s:.0f} s"
                ),
            },
        )
        return
    timeout = max(1.0, min(part.timeout_s, run.deadline_s - run.elapsed()))
    started = time.monotonic()
    env = {**os.environ, "KEMPNERFORGE_CACHE": str(run.work / "cache")}
    try:
        done = subprocess.run(
            part.command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        log_part(run, part, None, _text(e.stderr))
        record_many(
            run,
            part,
            {"status": "fail", "reason": f"timed out after {timeout:.0f} s"},
            time.monotonic() - started,
        )
        return
    log_part(run, part, done.returncode, done.stderr)
    record_many(run, part, outcome(done), time.monotonic() - started)


def _text(data: bytes | str | None) -> str:
    if isinstance(data, bytes):
        return data.decode(errors="replace")
    return data or ""


def outcome(done: subprocess.CompletedProcess) -> dict[str, Any]:
    """A part's result from its process: the JSON line it printed, or why there is none."""
    refusals = [line for line in done.stderr.splitlines() if "train.float8 = True: " in line]
    if done.returncode == 2 and refusals:
        return {"status": "skipped", "reason": refusals[-1]}  # FP8 refused here, in one line
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip()[-1500:]
        return {"status": "fail", "reason": f"exit {done.returncode}: {tail}"}
    try:
        result = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"status": "fail", "reason": f"no JSON line in its output: {lines[-1][-300:]}"}
    return result


def _named(result: dict[str, Any]) -> bool:
    """Whether a check printed several results by name (each a dict with a status)."""
    return bool(result) and all(isinstance(v, dict) and "status" in v for v in result.values())


def record_many(run: Run, part: Part, result: dict[str, Any], seconds: float) -> None:
    if _named(result):
        for name, one in result.items():
            run.record(name, part.group, {**one, "seconds": round(seconds, 1)})
        return
    result.setdefault("status", "pass")
    run.record(part.name, part.group, {**result, "seconds": round(seconds, 1)})


def log_part(run: Run, part: Part, code: int | None, stderr: str) -> None:
    """Append the end of a part's stderr to parts.log, for a failure's full story."""
    with run.lock, open(run.out / "parts.log", "a") as log:
        log.write(f"=== {part.name} (exit {code}) {' '.join(part.command)}\n")
        log.write(stderr[-6000:] + "\n")


def run_all(run: Run, only: set[str], workers: int) -> None:
    for item in plan(run):
        parts = [
            p for p in (item if isinstance(item, list) else [item]) if not only or p.name in only
        ]
        if len(parts) == 1:
            execute(parts[0], run)
        elif parts:
            with concurrent.futures.ThreadPoolExecutor(workers) as pool:
                list(pool.map(lambda p: execute(p, run), parts))
        print(f"[{run.elapsed():6.0f} s] {', '.join(p.name for p in parts) or '-'}", flush=True)


def meta(dry_run: bool, budget_s: float) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = None
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "dry_run": dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
        "torchao": torchao_version,
        "python": platform.python_version(),
        "commit": commit or "unknown",
        "budget_s": budget_s,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--out", default=str(REPO / "bench" / "gpu" / "out"))
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU, tiny")
    parser.add_argument("--budget-s", type=float, default=480, help="start no part after this")
    parser.add_argument("--deadline-s", type=float, default=570, help="stop any part here")
    parser.add_argument("--only", default="", help="comma-separated part names")
    parser.add_argument("--workers", type=int, default=0, help="checks at once (0: 4 GPU, 1 CPU)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"kempnerforge-gpu-suite-{os.getpid()}"
    run = Run(out, work, args.dry_run, args.budget_s, args.deadline_s)
    run.results["meta"] = meta(args.dry_run, args.budget_s)
    only = {name for name in args.only.split(",") if name}
    run_all(run, only, args.workers or (1 if args.dry_run else 4))
    summary = run.results.get("summary", {})
    print(json.dumps(summary, indent=1), flush=True)
    print(f"commit {out / 'results.json'} as bench/results/{results_name(run.results['meta'])}")
    return 0


def results_name(m: dict[str, Any]) -> str:
    """The file name a run's results are committed under: date, GPU and torch version."""
    gpu = (m["gpu"] or "cpu").lower().replace(" ", "-")
    return f"{m['date']}-{gpu}-torch{m['torch'].split('+')[0]}.json"


if __name__ == "__main__":
    sys.exit(main())
