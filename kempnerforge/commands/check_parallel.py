"""`kempnerforge check-parallel`: train one config under several parallel layouts and compare
each with a single-process run, step by step. Imports no torch until it runs (only to count
the GPUs), like the rest of the command line."""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Sequence

from kempnerforge.core.errors import ConfigError
from kempnerforge.launch.parallel_check import (
    LAYOUT_RULE,
    PROG,
    REFERENCE,
    Comparison,
    Layout,
    RunOutcome,
    compare_runs,
    format_table,
    grad_accum_for,
    parse_layout,
    per_rank_batch_size,
    pipeline_overrides,
    read_step_rows,
    run_one,
    train_command,
)


class UsageError(Exception):
    """A bad command line: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse whose errors raise UsageError (one line, exit 2) instead of printing usage."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        usage=f"{PROG} CONFIG --layouts LAYOUT [LAYOUT ...] [--steps N] [--tolerance T] "
        "[--nproc N] [--runs-dir DIR] [--section.field=value ...]",
        description="Train CONFIG under each parallel layout and in one process, and compare "
        "their losses and gradient norms step by step. Exit 0: all layouts match; 1: a "
        "mismatch or a failed run; 2: bad arguments or config.",
        epilog="Any --section.field=value argument overrides CONFIG in every run, e.g. "
        "--model.n_layers=2. Layout keys: dp_shard, dp_replicate, tp, pp (1 when not "
        "named) and schedule (distributed.pp_schedule).",
    )
    parser.add_argument("config", help="the TOML config to train")
    parser.add_argument("--layouts", nargs="+", required=True, metavar="LAYOUT", help=LAYOUT_RULE)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (5)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest relative difference of loss and grad_norm that passes (1e-4)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=0,
        help="most processes one run may use on this machine (default: the GPU count "
        "where CUDA is available, else the CPU cores but at least 8); a larger layout is "
        "refused",
    )
    parser.add_argument(
        "--runs-dir",
        default="",
        help="keep every run's directory here (default: a temporary directory, removed)",
    )
    return parser


def _check_arguments(args: argparse.Namespace, extra: list[str]) -> list[Layout]:
    """Validate the command line; the layouts it names."""
    unknown = [a for a in extra if not a.startswith("--") or "." not in a.split("=")[0]]
    if unknown:
        raise UsageError(f"unrecognized arguments: {' '.join(unknown)}")
    if args.steps < 1:
        raise UsageError(f"--steps must be >= 1, got {args.steps}")
    if not (math.isfinite(args.tolerance) and args.tolerance >= 0):
        raise UsageError(f"--tolerance must be a number >= 0, got {args.tolerance}")
    if args.nproc < 0:
        raise UsageError(f"--nproc must be >= 0, got {args.nproc}")
    layouts = [parse_layout(text) for text in args.layouts]
    limit = args.nproc or _default_nproc()
    for layout in layouts:
        if limit and layout.world_size > limit:
            raise UsageError(
                f"layout {layout.text!r} needs {layout.world_size} processes, more than "
                f"--nproc = {limit}"
            )
    return layouts


def _default_nproc() -> int:
    """The GPU count where CUDA is available; on CPU the cores, and at least 8 (gloo ranks
    may share cores: this only stops a typo from starting thousands of processes)."""
    import torch  # only here: nothing else in this command needs it

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(os.cpu_count() or 1, 8)


def _run_dirs(root: str, layouts: Sequence[Layout]) -> list[str]:
    """The run directory of the reference, then of each layout; none may exist yet."""
    names = ["reference"] + [f"{i}_{layout.dir_name}" for i, layout in enumerate(layouts, 1)]
    dirs = [os.path.join(root, name) for name in names]
    for path in dirs:
        if os.path.exists(path):
            raise UsageError(f"{path} already exists: remove it or pick another --runs-dir")
    return dirs


def main(argv: Sequence[str] | None = None) -> int:
    """`kempnerforge check-parallel ...`; returns the exit code (0 match, 1 not, 2 bad input)."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        layouts = _check_arguments(args, extra)
        if args.runs_dir:
            os.makedirs(args.runs_dir, exist_ok=True)
            return _check(args, extra, layouts, args.runs_dir)
        with tempfile.TemporaryDirectory(prefix="check-parallel-") as root:
            return _check(args, extra, layouts, root)
    except (ConfigError, UsageError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def _check(args: argparse.Namespace, overrides: list[str], layouts: list[Layout], root: str) -> int:
    from kempnerforge.config.loader import load_config

    config = load_config(args.config, overrides)
    train = config.train
    for layout in layouts:  # refuse before anything runs
        per_rank_batch_size(train.batch_size, layout)
    extra, notes = pipeline_overrides(train.grad_accum_steps, config.data.document_masking, layouts)
    overrides = [*overrides, *extra]
    dirs = _run_dirs(root, layouts)
    grad_accum = grad_accum_for(train.grad_accum_steps, layouts)
    print(
        f"check-parallel: {args.config}, {args.steps} steps, global batch "
        f"{train.batch_size * grad_accum} sequences of {train.seq_len} tokens",
        flush=True,
    )
    for note in notes:
        print(f"note: {note}", flush=True)

    def launch(layout: Layout, run_dir: str) -> RunOutcome:
        command = train_command(
            args.config,
            layout,
            overrides,
            batch_size=train.batch_size,
            steps=args.steps,
            run_dir=run_dir,
        )
        return run_one(command, layout)

    reference = launch(REFERENCE, dirs[0])
    if reference.returncode != 0:
        print(f"the single-process reference run failed; its last lines:\n{reference.output_tail}")
        return 2 if reference.returncode == 2 else 1
    comparisons = []
    for layout, run_dir in zip(layouts, dirs[1:], strict=True):
        outcome = launch(layout, run_dir)
        if outcome.returncode == 0:
            rows, reference_rows = read_step_rows(run_dir), read_step_rows(dirs[0])
            comparisons.append(compare_runs(layout, rows, reference_rows, args.steps))
        else:
            problem = f"the run failed (exit code {outcome.returncode}); its last lines:"
            comparisons.append(Comparison(layout, problem=problem, output=outcome.output_tail))
    print(format_table(comparisons, args.tolerance, args.steps))
    for c in (c for c in comparisons if c.problem):
        print("\n".join(text for text in (f"{c.layout.text}: {c.problem}", c.output) if text))
    return 0 if all(c.passed(args.tolerance) for c in comparisons) else 1
