"""A fault soak: train under torchrun while faults strike on a schedule, relaunch after each,
and report the goodput and the steps each fault cost, with the memory tier and without.

    python bench/fault_soak.py [--minutes 20] [--fault-every 120] [--memory-interval 2]
                               [--checkpoint-interval 50] [--nproc 2]
                               [--hang-timeout-s 30] [--check [--against RUN_DIR]]
                               [--arms both|memory|disk]

Each arm (memory tier on: checkpoint.memory_interval = --memory-interval; off: 0) trains
the debug config's model (configs/train/debug.toml, FSDP over --nproc CPU ranks) for
--minutes of wall time. Every --fault-every seconds one fault strikes, in turn:

- worker: one rank's process killed with SIGKILL (the others fail their next collective
  and torchrun ends the job);
- node: torchrun and every rank killed with SIGKILL at once;
- hang: one rank stopped with SIGSTOP, so the others wait in a collective until the hang
  watchdog (train.hang_timeout_s = --hang-timeout-s) ends the job.

Each launch is torchrun as scripts/slurm/train.sbatch starts it on a node
(kempnerforge.launch.node_torchrun, --max_restarts=0): once a rank fails, the others get
a few seconds to exit before SIGKILL. After a fault the job is launched again at once, as
the script's requeue would, and resumes from the newest state it finds. At the end the last
launch is stopped with SIGTERM (it saves and exits). Reported per arm: the goodput account
of the run (`kempnerforge goodput`), and per fault the step reached before it, the step
resumed from and the steps lost. With --check, one uninterrupted run to the longer arm's
last step gives each step's loss, which every step of both arms must equal bitwise
(a deterministic CPU run); ``steps_differing`` counts those that do not.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kempnerforge.core.metrics_file import METRICS_FILE, iter_rows
from kempnerforge.metrics.goodput import account_file

REPO = Path(__file__).resolve().parents[1]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")
FAULTS = ("worker", "node", "hang")
MAX_STEPS = 1_000_000
"""train.max_steps of every launch: the soak ends by time, and its LR schedule is fixed."""


def rows(run_dir: Path) -> list[dict]:
    """The run's metrics rows (a row torn by a kill skipped), none before it has any."""
    path = run_dir / METRICS_FILE
    return list(iter_rows(path)) if path.exists() else []


def losses(run_dir: Path) -> dict[int, float]:
    """Each step's loss, the last logged one for a step logged twice."""
    return {r["step"]: r["loss"] for r in rows(run_dir) if "loss" in r and "event" not in r}


def children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def launch(run_dir: Path, args: argparse.Namespace, memory_interval: int, max_steps: int):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [
        sys.executable, "-m", "kempnerforge.launch.node_torchrun", "--standalone",
        f"--nproc_per_node={args.nproc}", "--max_restarts=0",
        "-m", "kempnerforge", "train", DEBUG,
        f"--train.run_dir={run_dir}", f"--train.max_steps={max_steps}",
        "--train.deterministic=true", "--train.sample_tokens=0", "--eval.interval=0",
        "--metrics.log_interval=1", "--metrics.progress=off",
        f"--distributed.dp_shard={args.nproc}", f"--train.hang_timeout_s={args.hang_timeout_s}",
        f"--checkpoint.interval={args.checkpoint_interval}",
        f"--checkpoint.memory_interval={memory_interval}",
        f"--checkpoint.memory_dir={args.shm}",
    ]  # fmt: skip
    log = open(run_dir.parent / f"{run_dir.name}.log", "a")  # noqa: SIM115 - the job's life
    return subprocess.Popen(
        command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def strike(job: subprocess.Popen, kind: str) -> list[int]:
    """The fault ``kind`` on ``job``; returns its ranks' pids (torchrun starts each rank in
    a process group of its own, so killing torchrun's group leaves them running)."""
    ranks = children(job.pid)
    if kind == "node" or not ranks:
        for pid in ranks:
            os.kill(pid, signal.SIGKILL)
        os.killpg(job.pid, signal.SIGKILL)
    elif kind == "worker":
        os.kill(ranks[-1], signal.SIGKILL)
    else:
        os.kill(ranks[-1], signal.SIGSTOP)
    return ranks


def reap(ranks: list[int]) -> None:
    """Kill whatever of a finished job's ranks is left (a stopped rank torchrun could not
    end), so no rank of an old launch trains beside the next one."""
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def soak(root: Path, args: argparse.Namespace, memory_interval: int) -> dict:
    run_dir = root / ("memory" if memory_interval else "disk")
    run_dir.mkdir(parents=True)
    max_steps = MAX_STEPS
    started = time.monotonic()
    faults: list[dict] = []
    job = launch(run_dir, args, memory_interval, max_steps)
    next_fault = started + args.fault_every
    while time.monotonic() - started < args.minutes * 60:
        time.sleep(1)
        if time.monotonic() >= next_fault:
            kind = FAULTS[len(faults) % len(FAULTS)]
            reached = max(losses(run_dir), default=0)
            ranks = strike(job, kind)
            try:
                job.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(job.pid, signal.SIGKILL)
                job.wait()
            reap(ranks)
            faults.append({"kind": kind, "reached": reached})
            job = launch(run_dir, args, memory_interval, max_steps)
            next_fault = time.monotonic() + args.fault_every
    ranks = children(job.pid)
    os.killpg(job.pid, signal.SIGTERM)  # torchrun passes the stop to its ranks: they save
    job.wait(timeout=300)
    reap(ranks)
    resumes = [r for r in rows(run_dir) if r.get("event") == "resume"]
    for fault, resume in zip(faults, resumes, strict=False):
        fault["resumed"] = resume["step"]
        fault["from"] = "memory" if "memory tier" in str(resume.get("path")) else "checkpoint"
        fault["lost"] = fault["reached"] - resume["step"]
    report = account_file(run_dir / "metrics.jsonl")
    return {
        "memory_interval": memory_interval,
        "steps": max(losses(run_dir), default=0),
        "goodput": report.goodput,
        "seconds": report.seconds,
        "faults": faults,
        "run_dir": str(run_dir),
    }


def reference_losses(root: Path, args: argparse.Namespace, steps: int) -> dict[int, float]:
    """Each step's loss of a run without faults, trained to ``steps`` (the soak's
    train.max_steps, so the same LR schedule, stopped once it has logged them)."""
    reference = root / "reference"
    reference.mkdir()
    job = launch(reference, args, 0, MAX_STEPS)
    while max(losses(reference), default=0) < steps and job.poll() is None:
        time.sleep(1)
    ranks = children(job.pid)
    os.killpg(job.pid, signal.SIGTERM)
    job.wait(timeout=300)
    reap(ranks)
    return losses(reference)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--fault-every", type=float, default=120.0)
    parser.add_argument("--memory-interval", type=int, default=2)
    parser.add_argument("--checkpoint-interval", type=int, default=50)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hang-timeout-s", type=float, default=30.0)
    parser.add_argument("--check", action="store_true")
    parser.add_argument(
        "--arms", choices=("both", "memory", "disk"), default="both", help="which arms to run"
    )
    parser.add_argument(
        "--against",
        help="with --check, an earlier uninterrupted run's directory (a soak's reference/) "
        "to compare with instead of training one; steps past its last are counted unchecked",
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="fault-soak-"))
    # The memory tier's copies in a tmpfs of their own, removed at the end (a soak's last
    # launch is stopped, not finished, so its copies would stay).
    args.shm = tempfile.mkdtemp(
        prefix="fault-soak-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
    )
    try:
        intervals = {"both": (args.memory_interval, 0), "memory": (args.memory_interval,)}
        arms = intervals.get(args.arms, (0,))
        results = [soak(root, args, interval) for interval in arms]
        if args.check:  # one uninterrupted run serves both arms
            if args.against:
                want = losses(Path(args.against))
            else:
                want = reference_losses(root, args, max(r["steps"] for r in results))
            for result in results:
                got = losses(Path(result["run_dir"]))
                checked = {k: v for k, v in got.items() if k in want}
                result["steps_differing"] = sum(1 for k, v in checked.items() if want[k] != v)
                result["steps_unchecked"] = len(got) - len(checked)
        for result in results:
            print(json.dumps(result), flush=True)
    finally:
        shutil.rmtree(args.shm, ignore_errors=True)


if __name__ == "__main__":
    main()
