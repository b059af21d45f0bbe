"""Time to the first step and peak memory of a training process over a huge prepared corpus.

Writes a sparse ``tokens.bin`` of ``--tokens`` uint16 ids (all zero: the file takes no
disk space, reads cost what the kernel charges for holes) with a hand-written meta.json,
then runs `kempnerforge train` on it for one step with the debug model and reports, as
the median of ``--runs``: the seconds from the command's start to the end of step 1 (the
metrics row of step 1 is written when it ends), the peak resident memory of the training
process (its ru_maxrss, which counts the pages of the memory-mapped tokens.bin it touched:
reclaimable page cache) and the peak of its anonymous memory (RssAnon, sampled every 50 ms:
what the process itself allocated). A run still going after ``--timeout`` seconds, or whose
anonymous memory passes ``--anon-cap-gib`` (so that a run which would exhaust the machine
stops first), is killed and reported as such.

    python bench/data_open.py --tokens 1e9 1e11 1e12 [--runs 3] [--dir /a/filesystem/with/room]

The corpus directory is kept between runs (``--dir``, default a directory under /tmp);
it needs a filesystem that stores holes (ext4, xfs: a 1e12-token file is 2 TB of holes).
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
from pathlib import Path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS_ID = 257  # the byte tokenizer's; the zero ids of the file are bytes, so one document


def write_sparse_corpus(directory: Path, num_tokens: int) -> None:
    """A prepared directory of ``num_tokens`` zero uint16 ids, declared by hand."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = directory / "tokens.bin"
    with open(tokens, "wb") as f:
        f.truncate(num_tokens * 2)
    meta = {
        "format_version": 1,
        "dtype": "uint16",
        "vocab_size": 259,
        "num_tokens": num_tokens,
        "num_documents": 1,
        "tokenizer": "byte",
        "eos_id": EOS_ID,
        "bos_id": 256,
        "bos_per_document": False,
        "content_sha256": "not-computed",
        "sources": 1,
        "max_token_id": 0,
    }
    (directory / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def anon_gib(pid: int) -> float:
    """The anonymous resident memory of process ``pid`` in GiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return 0.0


def one_run(
    data_dir: Path, timeout_s: float, anon_cap_gib: float
) -> tuple[float | None, float, float, str]:
    """(seconds to the end of step 1 or None if it did not get there, peak RSS in GiB,
    peak anonymous memory in GiB, why it stopped early or "")."""
    with tempfile.TemporaryDirectory() as run_dir:
        command = [
            sys.executable, "-m", "kempnerforge", "train", "configs/train/debug.toml",
            "--train.max_steps=1", f"--train.run_dir={run_dir}", f"--data.path={data_dir}",
            "--data.eval_path=", "--eval.interval=0", "--checkpoint.interval=0",
            "--train.sample_prompt=", "--metrics.progress=off",
        ]  # fmt: skip
        started = time.time()
        process = subprocess.Popen(
            command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        peak_anon = 0.0
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                peak_gib = usage.ru_maxrss / 2**20  # KiB on Linux
                break
            peak_anon = max(peak_anon, anon_gib(process.pid))
            stop = ""
            if time.monotonic() > deadline:
                stop = f"still running after {timeout_s:.0f} s"
            elif peak_anon > anon_cap_gib:
                stop = f"anonymous memory passed {anon_cap_gib:.0f} GiB"
            if stop:
                process.kill()
                _, status, usage = os.wait4(process.pid, 0)
                stop += f" ({time.time() - started:.0f} s after the start)"
                return None, usage.ru_maxrss / 2**20, peak_anon, stop
            time.sleep(0.05)
        metrics = Path(run_dir) / "metrics.jsonl"
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        rows = [json.loads(line) for line in lines]
    first = next((r for r in rows if r.get("step") == 1 and "loss" in r), None)
    if first is None or os.waitstatus_to_exitcode(status) != 0:
        return None, peak_gib, peak_anon, f"exit code {os.waitstatus_to_exitcode(status)}"
    return first["time"] - started, peak_gib, peak_anon, ""


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tokens", type=float, nargs="+", default=[1e9])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--anon-cap-gib", type=float, default=16.0)
    parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "kf-sparse-corpora"))
    args = parser.parse_args()
    for count in args.tokens:
        num_tokens = int(count)
        data_dir = Path(args.dir) / f"tokens-{num_tokens:.0e}"
        write_sparse_corpus(data_dir, num_tokens)
        results = [one_run(data_dir, args.timeout, args.anon_cap_gib) for _ in range(args.runs)]
        firsts = [r[0] for r in results if r[0] is not None]
        stops = sorted({r[3] for r in results if r[3]})
        reached = (
            f"median {statistics.median(firsts):.2f} s (min {min(firsts):.2f}, "
            f"max {max(firsts):.2f})"
            if len(firsts) == len(results)
            else f"not reached in {len(results) - len(firsts)} of {len(results)} runs: "
            + "; ".join(stops)
        )
        print(
            f"{num_tokens:.0e} tokens: to the end of step 1 {reached}; peak RSS median "
            f"{statistics.median(r[1] for r in results):.2f} GiB, peak anonymous memory "
            f"median {statistics.median(r[2] for r in results):.2f} GiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
