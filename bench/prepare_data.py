"""Tokens per second of `prepare-data` with a Hugging Face BPE tokenizer, per worker count.

Trains a small byte-level BPE tokenizer.json with the `tokenizers` package on this
interpreter's standard library source (nothing downloaded), then prepares the first `--mb`
megabytes of that source (sorted .py files, one document each) `--repeats` rounds, each
round running every setting once in a fresh process (alternating, so a machine whose load
drifts slows every setting alike), and prints one JSON line per setting with medians over
the rounds: seconds (wall clock of the prepare_data call: reading, tokenizing, writing,
worker start-up included), tokens_per_sec, tokens_per_sec_per_worker, and
tokens_per_cpu_sec (tokens over the CPU time of the process and its workers: what one busy
core does, less sensitive to other load on a shared machine than the wall clock).

Settings: `--workers 1` as shipped (the tokenizer library's own threads may use every
core), `--workers 1` with TOKENIZERS_PARALLELISM=false (one core), and each `--workers N`
of `--worker-counts` (each worker encodes on one core).

    python bench/prepare_data.py [--mb 8] [--repeats 3] [--vocab 8192] [--worker-counts 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def source_files(limit_bytes: int) -> list[Path]:
    """The first standard library .py files in sorted order, up to ``limit_bytes`` of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts or not path.is_file():
            continue
        files.append(path)
        total += path.stat().st_size
        if total >= limit_bytes:
            break
    return files


def train_tokenizer(files: list[Path], vocab_size: int, out: Path) -> str:
    """A byte-level BPE tokenizer.json trained on ``files`` (unreadable ones skipped)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def texts():
        for path in files:
            try:
                yield path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts(), trainer=trainer)
    tok.save(str(out))
    return str(out)


def measure(list_file: str, tokenizer: str, workers: int, output: str) -> None:
    """One timed prepare_data run in this process; prints {"seconds", "tokens"}."""
    from kempnerforge.data.prepare.corpus import prepare_data
    from kempnerforge.data.tokenizer import load_tokenizer

    files = Path(list_file).read_text().splitlines()
    tok = load_tokenizer(tokenizer)
    cpu_before, started = os.times(), time.perf_counter()
    meta = prepare_data(
        files, output, tok, num_workers=workers, text_suffixes=(".py",), skip_non_utf8=True
    )
    # The workers have exited (the pool is joined), so their CPU time counts as children's.
    seconds, cpu_after = time.perf_counter() - started, os.times()
    cpu = sum(cpu_after[:4]) - sum(cpu_before[:4])
    print(json.dumps({"seconds": seconds, "cpu_seconds": cpu, "tokens": meta["num_tokens"]}))


def one_run(list_file: str, tokenizer: str, workers: int, env: dict[str, str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable, __file__, "--measure", list_file, "--tokenizer", tokenizer,
            "--workers", str(workers), "--output", os.path.join(out, "data"),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        proc = subprocess.run(command, env=env, check=True, capture_output=True, text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.0, help="megabytes of source to prepare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--worker-counts", type=int, nargs="+", default=[2])
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(args.measure, args.tokenizer, args.workers, args.output)
        return
    files = source_files(int(args.mb * 1e6))
    with tempfile.TemporaryDirectory() as work:
        tokenizer = train_tokenizer(files, args.vocab, Path(work) / "tokenizer.json")
        list_file = Path(work) / "files.txt"
        list_file.write_text("\n".join(str(p) for p in files) + "\n")
        settings = [("1", 1, {}), ("1, TOKENIZERS_PARALLELISM=false", 1, {})]
        settings[1][2]["TOKENIZERS_PARALLELISM"] = "false"
        settings += [(str(n), n, {}) for n in args.worker_counts]
        runs: dict[str, list[dict]] = {name: [] for name, _, _ in settings}
        for _ in range(args.repeats):
            for name, workers, env in settings:
                runs[name].append(one_run(str(list_file), tokenizer, workers, env))
        for name, workers, _ in settings:
            seconds = statistics.median(r["seconds"] for r in runs[name])
            cpu_seconds = statistics.median(r["cpu_seconds"] for r in runs[name])
            tokens = runs[name][0]["tokens"]
            figures = {
                "workers": name,
                "files": len(files),
                "mb": round(sum(p.stat().st_size for p in files) / 1e6, 1),
                "vocab": args.vocab,
                "seconds": round(seconds, 2),
                "seconds_all": [round(r["seconds"], 2) for r in runs[name]],
                "tokens": tokens,
                "tokens_per_sec": round(tokens / seconds),
                "tokens_per_sec_per_worker": round(tokens / seconds / workers),
                "tokens_per_cpu_sec": round(tokens / cpu_seconds),
            }
            print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
