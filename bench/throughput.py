"""Tokens/s and peak memory of `kempnerforge train` against a hand-written PyTorch loop.

The baseline is bench/bare_loop.py: the same model shape, batch, optimizer hyperparameters
and data, in plain PyTorch as a user writes it (its own Llama module, torch.optim.AdamW
with its default implementation, F.cross_entropy over the full logits), importing nothing
from kempnerforge. Each variant runs in a fresh process, the variants alternate within a
round (so a drift in the machine's speed hits all of them alike), and the report gives
each one's median over the rounds and its ratio to the bare loop's median.

Variants: `kempnerforge` (the config as it is) and, with --levers, the same run with one
speed lever turned off at a time, so each lever's share is measured on its own:
allocator=system, optimizer.implementation=for_loop, train.loss_chunk_tokens=0 and
data.document_masking=false (masking's cost); --compile adds train.compile=true (its
first step, the compilation, is reported apart). Both sides time wall clock from the end
of warm-up step `--skip` to the end of the last step; eval, checkpoints and the sample
are off. Run alone on the machine.

    python bench/throughput.py                                  # debug preset
    python bench/throughput.py --levers --rounds 3
    python bench/throughput.py --config configs/train/debug.toml \\
        --model configs/model/125m.toml --batch-size 4 --steps 8 --skip 3   # ~100M model
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

from kempnerforge.config.loader import load_config
from kempnerforge.data.builtin import builtin_corpus, default_cache_dir
from kempnerforge.data.tokenizer import ByteTokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Variant:
    name: str
    overrides: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


LEVERS = [
    Variant("allocator=system", env={"KEMPNERFORGE_ALLOCATOR": "system"}),
    Variant("optimizer.implementation=for_loop", ["--optimizer.implementation=for_loop"]),
    Variant("train.loss_chunk_tokens=0", ["--train.loss_chunk_tokens=0"]),
    Variant("data.document_masking=false", ["--data.document_masking=false"]),
]


@dataclass
class Result:
    tokens_per_sec: float
    peak_memory_gib: float
    first_step_s: float | None = None


def run_framework(args: argparse.Namespace, variant: Variant) -> Result:
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable, "-m", "kempnerforge", "train", args.config_file,
            f"--train.max_steps={args.steps}", f"--train.run_dir={run_dir}",
            f"--train.batch_size={args.batch_size}", f"--train.seq_len={args.seq_len}",
            "--eval.interval=0", "--checkpoint.interval=0", "--train.sample_prompt=",
            "--metrics.log_interval=1", "--metrics.progress=off", *variant.overrides,
        ]  # fmt: skip
        env = {**os.environ, **variant.env}
        subprocess.run(
            command, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )  # fmt: skip
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    rows = [r for r in rows if "event" not in r and "loss" in r]
    by_step = {r["step"]: r for r in rows}
    seconds = by_step[args.steps]["time"] - by_step[args.skip]["time"]
    tokens = by_step[args.steps]["tokens_seen"] - by_step[args.skip]["tokens_seen"]
    peak = max(r.get("peak_memory_gib") or 0.0 for r in rows)
    return Result(tokens / seconds, peak, by_step[1]["step_time_s"])


def bare_args(args: argparse.Namespace) -> list[str]:
    """bench/bare_loop.py's arguments for the job the framework runs."""
    config = load_config(args.config_file, [f"--train.batch_size={args.batch_size}"])
    mc, tc, oc, sc = config.model, config.train, config.optimizer, config.scheduler
    tokens = config.data.path
    if not tokens:
        train_dir, _ = builtin_corpus(
            default_cache_dir(), ByteTokenizer(), config.data.builtin_eval_fraction
        )
        tokens = train_dir
    return [
        f"--vocab={mc.vocab_size}", f"--dim={mc.dim}", f"--n-layers={mc.n_layers}",
        f"--n-heads={mc.n_heads}", f"--n-kv-heads={mc.kv_heads}",
        f"--ffn-hidden={mc.hidden_dim}", f"--rope-theta={mc.rope_theta}",
        f"--norm-eps={mc.norm_eps}", f"--seq-len={args.seq_len}",
        f"--batch-size={args.batch_size}", f"--lr={oc.lr}",
        "--betas", str(oc.betas[0]), str(oc.betas[1]), f"--weight-decay={oc.weight_decay}",
        f"--warmup-steps={sc.warmup_steps}", f"--grad-clip={tc.grad_clip_norm}",
        f"--steps={args.steps}", f"--skip={args.skip}",
        f"--tokens={os.path.join(tokens, 'tokens.bin')}",
    ]  # fmt: skip


def run_bare(args: argparse.Namespace, bare: list[str]) -> Result:
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bare_loop.py"), *bare],
        cwd=REPO, check=True, capture_output=True, text=True,
    )  # fmt: skip
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return Result(result["tokens_per_sec"], result["peak_rss_gib"])


def write_config(args: argparse.Namespace, directory: str) -> str:
    """The config to train: --config, with --model's [model] in place of its own."""
    if not args.model:
        return os.path.abspath(args.config)
    path = os.path.join(directory, "bench.toml")
    with open(path, "w") as f:
        f.write(f'include = ["{os.path.abspath(args.config)}", "{os.path.abspath(args.model)}"]\n')
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--model", default="", help="a configs/model/*.toml to train instead")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    parser.add_argument("--levers", action="store_true", help="also each lever turned off")
    parser.add_argument("--compile", action="store_true", help="also train.compile=true")
    parser.add_argument("--json", default="", help="write every run's figures to this file")
    args = parser.parse_args()
    variants = [Variant("kempnerforge")]
    if args.levers:
        variants += LEVERS
    if args.compile:
        variants.append(Variant("train.compile=true", ["--train.compile=true"]))
    with tempfile.TemporaryDirectory() as scratch:
        args.config_file = write_config(args, scratch)
        bare = bare_args(args)
        runs: dict[str, list[Result]] = {v.name: [] for v in variants}
        runs["bare PyTorch"] = []
        for i in range(args.rounds):
            runs["bare PyTorch"].append(run_bare(args, bare))
            for variant in variants:
                runs[variant.name].append(run_framework(args, variant))
            line = " | ".join(f"{n} {r[-1].tokens_per_sec:,.0f}" for n, r in runs.items())
            print(f"round {i + 1} (tok/s): {line}", flush=True)
    base = statistics.median(r.tokens_per_sec for r in runs["bare PyTorch"])
    print(f"\n{'variant':36} {'tok/s':>9} {'x bare':>7} {'peak GiB':>9}")
    for name, results in runs.items():
        tps = statistics.median(r.tokens_per_sec for r in results)
        mem = statistics.median(r.peak_memory_gib for r in results)
        print(f"{name:36} {tps:9,.0f} {tps / base:7.3f} {mem:9.2f}")
        firsts = [r.first_step_s for r in results if r.first_step_s is not None]
        if name == "train.compile=true" and firsts:
            print(f"{'':36} first step (compilation) {statistics.median(firsts):.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: [vars(r) for r in rs] for n, rs in runs.items()}, f, indent=1)


if __name__ == "__main__":
    main()
