"""`kempnerforge check-parallel`: train one config under several parallel layouts and compare
each with a single-process run, step by step. Imports no torch until it runs (only to count
the GPUs), like the rest of the command line."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kempnerforge.core.errors import ConfigError
from kempnerforge.launch.layout_batches import batches, run_batch
from kempnerforge.launch.layout_sweep import (
    ALL_LAYOUTS,
    DEFAULT_SWEEP_NPROC,
    Refusal,
    format_refusals,
    refusal_of,
    sweep_layouts,
)
from kempnerforge.launch.parallel_check import (
    DEGREES,
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
    run_overrides,
    train_command,
)

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig


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
        "their losses and gradient norms step by step. A layout a launch would refuse is "
        "reported with its config error and not run. Exit 0: all layouts match; 1: a "
        "mismatch, a failed run or a refused layout; 2: bad arguments or config.",
        epilog="Any --section.field=value argument overrides CONFIG in every run, e.g. "
        "--model.n_layers=2. Layout keys: "
        + ", ".join(DEGREES)
        + " (1 when not named; ring, a divisor of cp, runs ring attention with cp / ring "
        "Ulysses ranks in each ring rank, and unnamed keeps the config's "
        "distributed.cp_attention) and schedule (distributed.pp_schedule). A pipeline layout "
        "raises train.grad_accum_steps of every run to what it needs (a multiple of pp; "
        "2 * pp or more with dualpipev) and says so. --layouts all sweeps every layout of 2 "
        f"to --nproc processes (default {DEFAULT_SWEEP_NPROC}): each mesh, each pipeline "
        "schedule, each expert-parallel degree of an MoE model, each ring of a cp degree; it "
        "runs the config as given, "
        "lists the layouts a launch refuses with the field at fault, and exits 0 when every "
        "other layout matches.",
    )
    parser.add_argument("config", help="the TOML config to train")
    parser.add_argument(
        "--layouts",
        nargs="+",
        required=True,
        metavar="LAYOUT",
        help=f"{LAYOUT_RULE}; or {ALL_LAYOUTS!r}",
    )
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
        "where CUDA is available, else the CPU cores but at least 8; with --layouts all, "
        f"{DEFAULT_SWEEP_NPROC}); a larger layout is refused",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the layouts a launch accepts and the ones it refuses (with the field at "
        "fault), and run nothing",
    )
    parser.add_argument(
        "--fresh-processes",
        action="store_true",
        help="one launch per layout, each launcher and the reference a fresh interpreter; "
        "by default the layouts of one world size train one after another in one launch "
        "(each run still builds everything from the config and the seed; a failed run is "
        "rerun in a launch of its own), and the reference and each launcher are forked "
        "from this process, which has imported torch already",
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
    if ALL_LAYOUTS in args.layouts:
        if len(args.layouts) > 1:
            raise UsageError(f"--layouts {ALL_LAYOUTS} takes no other layout")
        return []  # enumerated once the config says whether the model has experts
    layouts = [parse_layout(text) for text in args.layouts]
    if len(set(layouts)) < len(layouts):
        raise UsageError("--layouts names the same layout twice")
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


@dataclass
class _Plan:
    """What a check runs: its layouts, the overrides every run shares, and what it says."""

    layouts: list[Layout]
    overrides: list[str]
    grad_accum: int
    notes: list[str]
    sweep: bool


def _plan(
    args: argparse.Namespace, overrides: list[str], layouts: list[Layout], config: JobConfig
) -> _Plan:
    """The named layouts with what pipeline layouts change in every run; or, for a sweep
    (no layouts named), every layout up to --nproc processes and the config as given,
    validation deciding which of them it admits."""
    train = config.train
    if not layouts:
        swept = sweep_layouts(args.nproc or DEFAULT_SWEEP_NPROC, config.model.is_moe)
        return _Plan(swept, overrides, train.grad_accum_steps, [], sweep=True)
    for layout in layouts:  # refuse before anything runs
        per_rank_batch_size(train.batch_size, layout)
    extra, notes = pipeline_overrides(train.grad_accum_steps, layouts)
    grad_accum = grad_accum_for(train.grad_accum_steps, layouts)
    return _Plan(layouts, [*overrides, *extra], grad_accum, notes, sweep=False)


def _check(args: argparse.Namespace, overrides: list[str], layouts: list[Layout], root: str) -> int:
    from kempnerforge.config.loader import load_config

    config = load_config(args.config, overrides)
    train = config.train
    plan = _plan(args, overrides, layouts, config)
    layouts = plan.layouts
    dirs = dict(zip([REFERENCE, *layouts], _run_dirs(root, layouts), strict=True))

    def run_args(layout: Layout) -> list[str]:
        return run_overrides(
            layout,
            plan.overrides,
            batch_size=train.batch_size,
            steps=args.steps,
            run_dir=dirs[layout],
        )

    refusals = _refusals(args.config, layouts, run_args)
    refused = {r.layout for r in refusals}
    print(
        f"check-parallel: {args.config}, {args.steps} steps, global batch "
        f"{train.batch_size * plan.grad_accum} sequences of {train.seq_len} tokens",
        flush=True,
    )
    if plan.sweep:
        print(
            f"{len(layouts)} layouts of 2 to {args.nproc or DEFAULT_SWEEP_NPROC} processes: "
            f"{len(layouts) - len(refusals)} accepted, {len(refusals)} refused by validation",
            flush=True,
        )
    for line in [*(f"note: {note}" for note in plan.notes), format_refusals(refusals)]:
        if line:
            print(line, flush=True)
    if args.dry_run:
        accepted = [layout.text for layout in layouts if layout not in refused]
        print(f"accepted ({len(accepted)}): {' '.join(accepted)}")
        return 0
    # A layout named on the command line that cannot run as asked fails the check.
    comparisons = [] if plan.sweep else [_refused(r.layout) for r in refusals]
    if len(refused) < len(layouts):  # else nothing to run, not even the reference
        fork = not args.fresh_processes
        reference = train_command(args.config, REFERENCE, run_args(REFERENCE))
        outcome = run_one(reference, REFERENCE, fork=fork)
        if outcome.returncode != 0:
            print(
                f"the single-process reference run failed; its last lines:\n{outcome.output_tail}"
            )
            return 2 if outcome.returncode == 2 else 1
        accepted = [layout for layout in layouts if layout not in refused]
        batched: dict[Layout, RunOutcome] = {}
        for batch in [] if args.fresh_processes else batches(accepted):
            batched |= run_batch(args.config, batch, run_args, dirs, root, fork=fork)
        for layout in accepted:
            outcome = batched.get(layout) or run_one(
                train_command(args.config, layout, run_args(layout)), layout, fork=fork
            )
            comparisons.append(_compare(layout, outcome, dirs[layout], dirs[REFERENCE], args))
    comparisons.sort(key=lambda c: layouts.index(c.layout))  # in the order they were named
    _report(comparisons, args, len(refusals) if plan.sweep else None)
    return 0 if all(c.passed(args.tolerance) for c in comparisons) else 1


def _refused(layout: Layout) -> Comparison:
    return Comparison(layout, problem="refused", refused=True)


def _report(
    comparisons: Sequence[Comparison], args: argparse.Namespace, swept_refusals: int | None
) -> None:
    """The table, each failed run's error, and a sweep's one-line summary."""
    if comparisons:
        print(format_table(comparisons, args.tolerance, args.steps))
    for c in (c for c in comparisons if c.problem and not c.refused):
        print("\n".join(text for text in (f"{c.layout.text}: {c.problem}", c.output) if text))
    if swept_refusals is not None:
        passed = sum(c.passed(args.tolerance) for c in comparisons)
        print(
            f"sweep: {len(comparisons)} accepted layouts checked, {passed} pass, "
            f"{len(comparisons) - passed} fail; {swept_refusals} refused by validation",
            flush=True,
        )


def _refusals(
    config_path: str, layouts: Sequence[Layout], run_args: Callable[[Layout], list[str]]
) -> list[Refusal]:
    """The layouts a launch would refuse: the checks `kempnerforge train` runs before it
    starts anything (validate for the layout's world size, then preflight), on the config
    each run would load."""
    from kempnerforge.config.loader import load_config
    from kempnerforge.training.preflight import preflight

    def launch_checks(layout: Layout) -> None:
        config = load_config(config_path, run_args(layout))
        config.validate(layout.world_size)
        preflight(config)

    # The checks' warnings (a warm-up longer than the run, say) are the runs' to print,
    # once each, not once per layout here.
    logging.disable(logging.WARNING)
    try:
        found = [refusal_of(layout, launch_checks) for layout in layouts]
    finally:
        logging.disable(logging.NOTSET)
    return [r for r in found if r is not None]


def _compare(
    layout: Layout, outcome: RunOutcome, run_dir: str, reference_dir: str, args: argparse.Namespace
) -> Comparison:
    """A finished run's rows against the reference's, or why there are none."""
    if outcome.returncode != 0:
        problem = f"the run failed (exit code {outcome.returncode}); its last lines:"
        return Comparison(layout, problem=problem, output=outcome.output_tail)
    return compare_runs(layout, read_step_rows(run_dir), read_step_rows(reference_dir), args.steps)
