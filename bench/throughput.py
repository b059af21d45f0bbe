"""Tokens/s of the debug model through `kempnerforge train` against a bare PyTorch loop.

Runs the two alternately, each in a fresh process, and reports the median of each and
their ratio (target >= 0.95). Both time wall clock from the end of warm-up step `skip`
to the end of the last step, so every per-step cost of the framework (data pipeline,
metrics, hooks, NaN checks) is inside the measurement; eval and checkpoints are off in
both, as they are not part of a step. Run alone on the machine: `make bench`.

    python bench/throughput.py [--rounds 3] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def framework_tokens_per_sec(config: str, steps: int, skip: int, masking: bool) -> float:
    with tempfile.TemporaryDirectory() as run_dir:
        subprocess.run(
            [
                sys.executable, "-m", "kempnerforge", "train", config,
                f"--train.max_steps={steps}", f"--train.run_dir={run_dir}",
                "--eval.interval=0", "--checkpoint.interval=0", "--train.sample_prompt=",
                "--metrics.log_interval=1", "--metrics.progress=off",
                f"--data.document_masking={'true' if masking else 'false'}",
            ],
            cwd=REPO, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    rows = [r for r in rows if "event" not in r and "loss" in r]
    by_step = {r["step"]: r for r in rows}
    seconds = by_step[steps]["time"] - by_step[skip]["time"]
    tokens = by_step[steps]["tokens_seen"] - by_step[skip]["tokens_seen"]
    return tokens / seconds


def bare_tokens_per_sec(config: str, steps: int, skip: int) -> float:
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "bare_loop.py"), "--config", config,
         "--steps", str(steps), "--skip", str(skip)],
        cwd=REPO, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_sec"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--skip", type=int, default=5)
    args = parser.parse_args()
    framework, bare, masked = [], [], []
    for i in range(args.rounds):
        framework.append(framework_tokens_per_sec(args.config, args.steps, args.skip, False))
        bare.append(bare_tokens_per_sec(args.config, args.steps, args.skip))
        masked.append(framework_tokens_per_sec(args.config, args.steps, args.skip, True))
        print(
            f"round {i + 1}: kempnerforge {framework[-1]:,.0f} tok/s | bare {bare[-1]:,.0f} tok/s"
            f" | kempnerforge with document masking {masked[-1]:,.0f} tok/s",
            flush=True,
        )
    f, b, m = (statistics.median(x) for x in (framework, bare, masked))
    print(f"median: kempnerforge {f:,.0f} tok/s, bare PyTorch {b:,.0f} tok/s, ratio {f / b:.3f}")
    print(f"document masking on (the default): {m:,.0f} tok/s, {m / b:.3f} of bare")


if __name__ == "__main__":
    main()
