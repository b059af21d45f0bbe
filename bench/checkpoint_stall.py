"""How long CheckpointManager.save() blocks training, sync against async, and a load, on CPU.

For each model (the debug model and the 134M one of configs/model/125m.toml), after one
AdamW step so the optimizer moments exist: the time save() keeps the caller in sync mode
and in async mode (median of --rounds; the first async save, which also allocates the
staging buffers, is shown apart), the time until the async save is committed (save()
called to wait() returned), the checkpoint's size on disk and the write throughput of
each, and the time a resume takes: a fresh manager finds the checkpoint (checking it,
checksums included) and loads it (median of --rounds, the files in the page cache as after
a save). Target: the async stall under 10% of the sync stall. Run alone on the
machine (the load average is printed with the table):

    python bench/checkpoint_stall.py [--rounds 3] [--dir /path/on/the/target/filesystem]

The script uses only save(), wait() and load(), so running it with PYTHONPATH set to a
checkout of another version of the package measures that version the same way.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.loader import load_config
from kempnerforge.model import build_model
from kempnerforge.optim.optimizer import build_optimizer
from kempnerforge.optim.scheduler import build_scheduler

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {"debug": "configs/model/debug.toml", "134M": "configs/model/125m.toml"}


def build_parts(config_path: str):
    """Model, AdamW (after one step, so its moments exist) and scheduler for a model config."""
    config = load_config(os.path.join(REPO, config_path))
    torch.manual_seed(0)
    model = build_model(config.model)
    optimizer = build_optimizer(model, config.optimizer)
    scheduler = build_scheduler(optimizer, config.scheduler, max_steps=1000)
    tokens = torch.randint(0, config.model.vocab_size, (1, 17))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, scheduler


def dir_size_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def time_saves(root: Path, mode: str, parts, rounds: int) -> list[tuple[float, float, int]]:
    """(seconds save() blocked, seconds until committed, bytes on disk) for each save.

    One manager makes every save, as in a run: async mode reuses its staging buffers
    from the second save on. Every checkpoint but the last is deleted once measured (the
    disk and its page cache stay as empty as at the start); the last is left for
    time_resumes.
    """
    model, optimizer, scheduler = parts
    manager = CheckpointManager(CheckpointConfig(async_mode=mode), str(root / mode))
    results = []
    for step in range(1, rounds + 1):
        started = time.perf_counter()
        path = manager.save(
            step,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            train_state={"tokens_seen": 0},
        )
        returned = time.perf_counter()
        manager.wait()
        committed = time.perf_counter()
        results.append((returned - started, committed - started, dir_size_bytes(Path(path))))
        if step < rounds:
            shutil.rmtree(path)
    return results


def time_resumes(root: Path, mode: str, parts, rounds: int) -> list[float]:
    """Seconds each resume from the last checkpoint time_saves left in ``root/mode`` takes:
    a fresh manager, as a relaunched run has, finds it (checking it) and loads it."""
    model, optimizer, scheduler = parts
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        manager = CheckpointManager(CheckpointConfig(), str(root / mode))
        path = manager.find_resume_path()
        assert path is not None
        manager.load(path, model=model, optimizer=optimizer, scheduler=scheduler)
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-stall-", dir=args.dir))
    load = os.getloadavg()
    header = (
        f"{'model':>6} {'params':>8} {'size MB':>8} {'sync stall s':>12} {'sync MB/s':>9} "
        f"{'1st async s':>11} {'async stall s':>13} {'stall %':>7} "
        f"{'commit s':>8} {'async MB/s':>10} {'resume s':>8}"
    )
    rows = []
    try:
        for name in args.models:
            parts = build_parts(MODELS[name])
            params = sum(p.numel() for p in parts[0].parameters())
            sync = time_saves(root, "disabled", parts, args.rounds)
            # The first async save allocates the staging buffers: reported on its own.
            shutil.rmtree(root / "disabled")
            first, *asyn = time_saves(root, "async", parts, args.rounds + 1)
            resume_s = statistics.median(time_resumes(root, "async", parts, args.rounds))
            shutil.rmtree(root / "async")
            size_mb = sync[0][2] / 1e6
            sync_s = statistics.median(r[0] for r in sync)
            stall_s = statistics.median(r[0] for r in asyn)
            commit_s = statistics.median(r[1] for r in asyn)
            rows.append(
                f"{name:>6} {params / 1e6:>7.1f}M {size_mb:>8.1f} {sync_s:>12.3f} "
                f"{size_mb / sync_s:>9.0f} {first[0]:>11.3f} {stall_s:>13.3f} "
                f"{100 * stall_s / sync_s:>6.1f}% {commit_s:>8.3f} {size_mb / commit_s:>10.0f} "
                f"{resume_s:>8.3f}"
            )
            del parts
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average "
        f"before {load[0]:.2f}, median of {args.rounds}, written under {root.parent}"
    )
    print(header)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
