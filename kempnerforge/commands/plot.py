"""`kempnerforge plot`: draw the training curves of one or more runs, and where their wall
time went, as PNG files."""

from __future__ import annotations

import argparse
import os

from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.core.metrics_file import METRICS_FILE
from kempnerforge.metrics.goodput import account_file
from kempnerforge.metrics.plot import PLOTS_DIR, plot_goodput, plot_runs, read_curves, run_names


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge plot`."""
    parser.add_argument(
        "run_dirs",
        nargs="+",
        metavar="RUN_DIR",
        help=f"run directories (each holding {METRICS_FILE}); several are overlaid",
    )
    parser.add_argument(
        "--out",
        default="",
        help=f"directory for the PNGs (default: <first RUN_DIR>/{PLOTS_DIR})",
    )


def run_plot(args: argparse.Namespace, overrides: list[str]) -> int:
    """Plot every run of ``args.run_dirs`` into ``args.out``; print the files written; 0.

    A run directory without metrics.jsonl, or runs with nothing to plot, raise DataError;
    ``overrides`` (config overrides) do not apply to plotting and raise ConfigError.
    """
    if overrides:
        raise ConfigError(
            "<override>", " ".join(overrides), "none: kempnerforge plot reads metrics only"
        )
    paths = [os.path.join(d, METRICS_FILE) for d in args.run_dirs]
    for run_dir, path in zip(args.run_dirs, paths, strict=True):
        if not os.path.isfile(path):
            raise DataError(f"{run_dir}: no {METRICS_FILE} (not a run directory?)")
    names = run_names(args.run_dirs)
    runs = [read_curves(p, n) for p, n in zip(paths, names, strict=True)]
    if not any(run.points for run in runs):
        raise DataError(
            f"{', '.join(paths)}: no training or eval rows to plot (has the run logged a step?)"
        )
    out = args.out or os.path.join(args.run_dirs[0], PLOTS_DIR)
    for path in plot_runs(runs, out):
        print(path)
    breakdown = plot_goodput([(n, account_file(p)) for p, n in zip(paths, names, strict=True)], out)
    if breakdown is not None:
        print(breakdown)
    return 0
