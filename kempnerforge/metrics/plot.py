"""Training curves of one or more runs from their metrics.jsonl, as PNGs (`kempnerforge plot`).

One PNG per metric (loss, eval loss, learning rate, tokens/s, gradient norm, and DPO's,
GRPO's and MTP's when a run logged them) with one line per run, so runs compare on the same
axes, and goodput.png: each run's wall time split by cause (metrics/goodput.py), one
stacked bar per run. Reading follows the tracker's rules for a
resumed run: see read_curves. matplotlib (the ``plot`` extra) is imported only when
plotting, with the Agg backend, so the package never needs a display or matplotlib itself.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kempnerforge.core.errors import DataError
from kempnerforge.core.metrics_file import iter_rows
from kempnerforge.metrics.goodput import CAUSES, RESTART_EVENTS, GoodputReport

PLOTTED = {
    "loss": "training loss",
    "eval_loss": "eval loss",
    "lr": "learning rate",
    "tokens_per_sec": "tokens / s",
    "grad_norm": "gradient norm",
}
"""The metrics plotted, by their metrics.jsonl key, with their axis labels; one PNG each,
named <key>.png."""

OBJECTIVE_PLOTTED = {
    "rewards/margins": "DPO reward margin (chosen - rejected)",
    "rewards/accuracies": "DPO preference accuracy",
    "grpo/reward": "GRPO mean reward",
    "grpo/kl": "GRPO KL to the reference",
    "grpo/clip_ratio": "GRPO share of clipped tokens",
    "mtp/loss": "multi-token prediction loss",
}
"""The post-training objectives' and the MTP head's metrics, plotted as PLOTTED's when some
run logged them, each in <key with '/' as '_'>.png (grpo_reward.png)."""

GOODPUT_PLOT = "goodput.png"
"""The wall-time breakdown's file name, beside the curves."""

PLOTS_DIR = "plots"
"""Where the PNGs go by default, inside the first run directory."""


@dataclass
class RunCurves:
    """One run's plotted metrics: for each, its (step, value) points in step order."""

    name: str
    """The run's name in the legends."""
    points: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Metric key -> points; a metric the run never logged (finite) is absent."""


def read_curves(path: str | os.PathLike[str], name: str = "") -> RunCurves:
    """The plotted metrics (PLOTTED, OBJECTIVE_PLOTTED) of the metrics.jsonl at ``path``, as
    the run ended up with them.

    Rows are read in file order, and the row a metric takes at a step is the last one
    logged for that step: after a resume (or a NaN rollback) at step S the run redid the
    steps after S, so an event of RESTART_EVENTS also drops every earlier value of a
    step past S, including steps the restarted run did not log again. Event rows carry no
    plotted values; a null value (non-finite, as the tracker writes it) leaves a gap; an
    unreadable line (the torn last row of a killed run) is skipped.
    """
    values: dict[str, dict[int, float | None]] = {key: {} for key in PLOTTED | OBJECTIVE_PLOTTED}
    for row in iter_rows(path):
        if not _is_step(row.get("step")):
            continue
        step = int(row["step"])
        if "event" in row:
            if row["event"] in RESTART_EVENTS:
                for by_step in values.values():
                    for later in [s for s in by_step if s > step]:
                        del by_step[later]
            continue
        for key, by_step in values.items():
            if key in row:
                value = row[key]
                by_step[step] = float(value) if _is_finite(value) else None
    curves = RunCurves(name or str(path))
    for key, by_step in values.items():
        points = [(s, v) for s, v in sorted(by_step.items()) if v is not None]
        if points:
            curves.points[key] = points
    return curves


def _is_step(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def run_names(run_dirs: list[str]) -> list[str]:
    """Legend names: each directory's last component, or the path as given when two runs
    would share a name."""
    names = [Path(d).resolve().name or d for d in run_dirs]
    if len(set(names)) < len(names):
        return [os.path.normpath(d) for d in run_dirs]
    return names


def plot_runs(runs: list[RunCurves], out_dir: str | os.PathLike[str]) -> list[Path]:
    """Write <out_dir>/<key>.png for each PLOTTED (or OBJECTIVE_PLOTTED) metric some run
    has; return the paths.

    Each figure has one line per run that logged the metric, labelled with its name.
    Raises DataError when matplotlib is not installed.
    """
    _new_figure(1, 1)  # matplotlib present, before any directory is made
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for key, label in (PLOTTED | OBJECTIVE_PLOTTED).items():
        present = [run for run in runs if key in run.points]
        if not present:
            continue
        figure = _new_figure(8, 4.5)
        axes = figure.add_subplot()
        for run in present:
            steps, ys = zip(*run.points[key], strict=True)
            marker = "o" if len(steps) <= 30 else None
            axes.plot(steps, ys, label=run.name, marker=marker, markersize=3, linewidth=1.2)
        axes.set_xlabel("step")
        axes.set_ylabel(label)
        axes.set_title(label)
        axes.grid(True, alpha=0.3)
        axes.legend()
        figure.tight_layout()
        path = out / f"{key.replace('/', '_')}.png"
        figure.savefig(path, format="png")
        written.append(path)
    return written


def plot_goodput(
    reports: list[tuple[str, GoodputReport]], out_dir: str | os.PathLike[str]
) -> Path | None:
    """Write <out_dir>/goodput.png: per run, a bar of its wall time split into the CAUSES'
    shares (labelled with its goodput share); None, and no file, when no run has wall time.
    Raises DataError when matplotlib is not installed."""
    present = [(name, report) for name, report in reports if report.total_s > 0]
    if not present:
        return None
    figure = _new_figure(10, 2.0 + 0.6 * len(present))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    axes = figure.add_subplot()
    names = [f"{name} ({report.goodput or 0:.0%})" for name, report in present]
    left = [0.0] * len(present)
    for cause in CAUSES:
        # A negative unattributed share (overlapping clocks) is drawn as nothing.
        widths = [max(report.shares()[cause], 0.0) for _, report in present]
        axes.barh(names, widths, left=left, label=cause)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    axes.invert_yaxis()  # the first run on top, as the runs were named
    axes.set_xlabel("share of wall time (goodput share in brackets)")
    axes.set_xlim(0, max(1.0, *left))
    axes.set_title("where the wall time went")
    axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    figure.tight_layout()
    path = out / GOODPUT_PLOT
    figure.savefig(path, format="png")
    return path


def _new_figure(width: float, height: float) -> Any:
    """A matplotlib Figure on the Agg canvas (whatever pyplot's default backend is);
    DataError naming the extra when matplotlib is missing."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise DataError(
            "kempnerforge plot needs matplotlib: pip install 'kempnerforge[plot]'"
        ) from None
    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure
