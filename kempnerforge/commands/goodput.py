"""`kempnerforge goodput`: where a run's wall time went, cause by cause, from its metrics."""

from __future__ import annotations

import argparse
import json
import os

from kempnerforge.core.errors import ConfigError, DataError
from kempnerforge.core.metrics_file import METRICS_FILE
from kempnerforge.metrics.goodput import CAUSES, GoodputReport, account_file


def add_goodput_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `kempnerforge goodput`."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help=f"a run directory (with {METRICS_FILE})")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")


def run_goodput(args: argparse.Namespace, overrides: list[str]) -> int:
    """Print the run's seconds and share per cause and its goodput share; 0.

    A directory without metrics.jsonl raises DataError naming it (the CLI exits 2);
    ``overrides`` (config overrides) do not apply and raise ConfigError.
    """
    if overrides:
        raise ConfigError(
            "<override>", " ".join(overrides), "none: kempnerforge goodput reads metrics only"
        )
    path = os.path.join(args.run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise DataError(f"{args.run_dir}: no {METRICS_FILE} (not a run directory?)")
    report = account_file(path)
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(format_report(report, args.run_dir))
    return 0


def format_report(report: GoodputReport, run_dir: str) -> str:
    """The table: one line per cause (seconds, share), the total, then the goodput share."""
    shares = report.shares()
    lines = [
        f"goodput of {run_dir} ({report.num_processes} process(es), {report.num_rows} rows)",
        f"{'cause':<14}{'seconds':>14}{'share':>9}  what it counts",
    ]
    for cause, what in CAUSES.items():
        lines.append(f"{cause:<14}{report.seconds[cause]:>14.3f}{shares[cause]:>9.2%}  {what}")
    lines.append(f"{'total':<14}{report.total_s:>14.3f}{sum(shares.values()):>9.2%}")
    share = report.goodput
    lines.append("goodput: " + ("n/a (no wall time yet)" if share is None else f"{share:.2%}"))
    return "\n".join(lines)
