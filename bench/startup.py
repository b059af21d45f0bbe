"""Seconds from the `kempnerforge train` command to the end of its first step.

Runs the debug config for one step in a fresh process, `--runs` times, and prints the
median and the spread of: the whole command's wall time, and the time from the command's
start to the end of step 1 (the metrics row of step 1 is written when it ends). The
built-in corpus is prepared once before the timed runs (a first run on a machine pays
that once; its cache is reused afterwards). Run alone on the machine.

    python bench/startup.py [--runs 5] [--config configs/train/debug.toml]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one_run(config: str, extra: list[str]) -> tuple[float, float]:
    """(seconds to the end of step 1, seconds for the whole command)."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable, "-m", "kempnerforge", "train", config, "--train.max_steps=1",
            f"--train.run_dir={run_dir}", "--eval.interval=0", "--checkpoint.interval=0",
            "--train.sample_prompt=", "--metrics.progress=off", *extra,
        ]  # fmt: skip
        started = time.time()
        subprocess.run(command, cwd=REPO, check=True, capture_output=True)
        ended = time.time()
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    first = next(r for r in rows if r.get("step") == 1 and "loss" in r)
    return first["time"] - started, ended - started


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--config", default="configs/train/debug.toml")
    parser.add_argument("--runs", type=int, default=5)
    args, extra = parser.parse_known_args()
    one_run(args.config, extra)  # prepares the built-in corpus, warms the file cache
    firsts, walls = zip(*(one_run(args.config, extra) for _ in range(args.runs)), strict=True)
    for name, values in (("to the end of step 1", firsts), ("whole command", walls)):
        print(
            f"{name}: median {statistics.median(values):.2f} s "
            f"(min {min(values):.2f}, max {max(values):.2f}, {args.runs} runs)"
        )


if __name__ == "__main__":
    main()
