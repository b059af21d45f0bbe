"""Training one config under several parallel layouts and comparing each run's losses and
gradient norms, step by step, with a single-process run (`kempnerforge check-parallel`).

Every run is a real `kempnerforge train` in its own processes (torchrun for a layout), with
the same global batch, seed and steps, so a layout that changes the numbers (a missed
reduction, a wrong shard, a pipeline that drops a micro-batch) shows up as a mismatch.
Importing this module stays light (no torch), like the rest of the CLI.
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kempnerforge.config.distributed import MESH_DIMS, PP_SCHEDULES
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.metrics_file import METRICS_FILE, iter_rows
from kempnerforge.launch.forked_command import run_captured

PROG = "kempnerforge check-parallel"
DEGREES = (*MESH_DIMS, "ep", "ring")
"""The layout keys that take a degree: the mesh dimensions; ep, which splits dp_shard; and
ring, which splits cp (the key/value ring's ranks, cp / ring Ulysses ranks in each)."""
LAYOUT_RULE = (
    "comma-separated key=value with keys "
    + ", ".join(DEGREES)
    + " (integers >= 1; ring a divisor of cp) and schedule ("
    + ", ".join(PP_SCHEDULES)
    + "), e.g. 'dp_shard=2', 'pp=2,schedule=1f1b', 'dp_shard=2,ep=2', 'cp=2' or 'cp=4,ring=2'"
)
STDERR_TAIL_LINES = 20
"""Lines of a failed run's stderr shown under the table."""

# Settings every run gets, the reference included: one metrics row per step, no eval, no
# sample, checkpoints only at the end, deterministic kernels, no progress bar.
COMMON_OVERRIDES = (
    "--metrics.log_interval=1",
    "--metrics.progress=off",
    "--eval.interval=0",
    "--train.sample_tokens=0",
    "--checkpoint.interval=0",
    "--train.deterministic=true",
    # The batch guard would refuse a changed grad_accum_steps; the batch is kept equal here.
    "--train.global_batch_size=0",
)


@dataclass(frozen=True)
class Layout:
    """One parallel layout to check: the five mesh degrees, the expert-parallel degree (a
    divisor of dp_shard, so not a factor of the world size), the ring of context
    parallelism (a divisor of cp, nor a factor) and an optional PP schedule."""

    text: str
    """The layout as given on the command line, e.g. 'pp=2,schedule=1f1b'."""
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    """Context-parallel degree: cp ranks share each data-parallel rank's batch."""
    tp: int = 1
    ep: int = 1
    ring: int = 0
    """Ranks of the key/value ring among the cp ranks: 1 exchanges heads only
    (distributed.cp_attention = 'ulysses'), more runs ring attention with cp / ring
    Ulysses ranks in each ring rank; 0 keeps the config's choice ('auto' by default)."""
    schedule: str = ""
    """distributed.pp_schedule, or empty to keep the config's."""

    @property
    def world_size(self) -> int:
        """Processes this layout runs on: the product of its mesh degrees."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def dir_name(self) -> str:
        """A directory name for this layout's run."""
        return re.sub(r"[^A-Za-z0-9._-]+", "_", self.text.replace("=", "")) or "layout"

    def overrides(self) -> list[str]:
        """The --distributed.* overrides that select this layout."""
        args = [f"--distributed.{dim}={getattr(self, dim)}" for dim in DEGREES if dim != "ring"]
        if self.ring == 1:
            args.append("--distributed.cp_attention=ulysses")
        elif self.ring > 1:
            args.append("--distributed.cp_attention=ring")
            args.append(f"--distributed.cp_ulysses={self.cp // self.ring}")
        if self.schedule:
            args.append(f"--distributed.pp_schedule={self.schedule}")
        return args


REFERENCE = Layout("reference")
"""The single-process run every layout is compared with."""


def parse_layout(text: str) -> Layout:
    """'dp_shard=2,tp=2' -> Layout; degrees not named are 1. Raises ConfigError."""
    values: dict[str, int | str] = {}
    for item in text.split(","):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or not key or not value:
            raise ConfigError("--layouts", text, LAYOUT_RULE)
        if key in values:
            raise ConfigError("--layouts", text, LAYOUT_RULE, f"{key!r} is given twice")
        if key == "schedule":
            if value not in PP_SCHEDULES:
                raise ConfigError("--layouts", text, LAYOUT_RULE, f"unknown schedule {value!r}")
            values[key] = value
        elif key in DEGREES:
            if not (value.isascii() and value.isdigit()) or int(value) < 1:
                raise ConfigError("--layouts", text, LAYOUT_RULE, f"{key} must be >= 1")
            values[key] = int(value)
        else:
            raise ConfigError("--layouts", text, LAYOUT_RULE, f"unknown key {key!r}")
    layout = Layout(text, **values)  # type: ignore[arg-type]
    if layout.schedule and layout.pp < 2:
        raise ConfigError("--layouts", text, LAYOUT_RULE, "schedule needs pp >= 2")
    if layout.ring and layout.cp % layout.ring:
        raise ConfigError("--layouts", text, LAYOUT_RULE, "ring must divide cp")
    return layout


def per_rank_batch_size(batch_size: int, layout: Layout) -> int:
    """train.batch_size for ``layout`` so its global batch equals the reference's."""
    if batch_size % layout.dp:
        raise ConfigError(
            "train.batch_size",
            batch_size,
            f"a multiple of the data-parallel degree {layout.dp} of layout {layout.text!r}",
            "every layout trains on the reference's global batch, split over its "
            "data-parallel ranks",
        )
    return batch_size // layout.dp


def grad_accum_for(grad_accum_steps: int, layouts: Sequence[Layout]) -> int:
    """train.grad_accum_steps for every run: the config's, unless a pipeline layout needs
    more (a multiple of its pp; with 'dualpipev' also at least its 2 * pp stages). Then the
    least multiple of every pp degree that is enough for each."""
    pps = [layout.pp for layout in layouts if layout.pp > 1]
    least = max((2 * lay.pp for lay in layouts if lay.schedule == "dualpipev"), default=1)
    if grad_accum_steps >= least and all(grad_accum_steps % pp == 0 for pp in pps):
        return grad_accum_steps
    step = math.lcm(*pps)
    return step * math.ceil(least / step)


def pipeline_overrides(
    grad_accum_steps: int, layouts: Sequence[Layout]
) -> tuple[list[str], list[str]]:
    """What every run, the reference included, must change so that the pipeline layouts
    among ``layouts`` can run and still compare: (overrides, a note for each)."""
    overrides, notes = [], []
    grad_accum = grad_accum_for(grad_accum_steps, layouts)
    if grad_accum != grad_accum_steps:
        overrides.append(f"--train.grad_accum_steps={grad_accum}")
        notes.append(
            f"train.grad_accum_steps = {grad_accum_steps} is not a multiple of every "
            f"layout's pp: every run, the reference included, uses {grad_accum}"
        )
    return overrides, notes


def run_overrides(
    layout: Layout,
    overrides: Sequence[str],
    *,
    batch_size: int,
    steps: int,
    run_dir: str,
) -> list[str]:
    """The --section.field=value arguments of one run: the check's own, then the layout's,
    then what every run shares; the config a launch of this layout validates."""
    return [
        *overrides,
        *layout.overrides(),
        *COMMON_OVERRIDES,
        f"--train.batch_size={per_rank_batch_size(batch_size, layout)}",
        f"--train.max_steps={steps}",
        f"--train.run_dir={run_dir}",
    ]


def train_command(config: str, layout: Layout, overrides: Sequence[str]) -> list[str]:
    """The `kempnerforge train` command line of one run (``overrides`` from run_overrides);
    torchrun for a layout."""
    torchrun = ["torch.distributed.run", "--standalone", f"--nproc_per_node={layout.world_size}"]
    launcher = [] if layout is REFERENCE else [*torchrun, "-m"]
    return [sys.executable, "-m", *launcher, "kempnerforge", "train", config, *overrides]


StepRows = dict[int, tuple[float | None, float | None]]
"""{step: (loss, grad_norm)}; None where metrics.jsonl has null (a non-finite value)."""


def read_step_rows(run_dir: str) -> StepRows:
    """The training rows of a run's metrics.jsonl; the last row of a step wins."""
    rows: StepRows = {}
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.exists(path):
        return rows
    for row in iter_rows(path):  # lenient: a killed run leaves a torn last row
        if "event" in row or "loss" not in row:
            continue
        rows[int(row["step"])] = (row.get("loss"), row.get("grad_norm"))
    return rows


def relative_diff(value: float, reference: float) -> float:
    """|value - reference| / |reference| (the absolute difference when reference is 0)."""
    return abs(value - reference) / (abs(reference) or 1.0)


@dataclass
class Comparison:
    """One layout against the reference: the largest relative differences, or why none."""

    layout: Layout
    loss_diff: float | None = None
    grad_norm_diff: float | None = None
    problem: str = ""
    """Why the layout fails regardless of the tolerance (its run failed, steps missing)."""
    output: str = ""
    """The end of a failed run's output."""
    refused: bool = False
    """Whether a launch of this layout would refuse its config (``problem`` says why)."""

    def passed(self, tolerance: float) -> bool:
        if self.problem or self.loss_diff is None or self.grad_norm_diff is None:
            return False
        return self.loss_diff <= tolerance and self.grad_norm_diff <= tolerance


def compare_runs(layout: Layout, rows: StepRows, reference: StepRows, steps: int) -> Comparison:
    """Compare steps 1..steps of a layout's rows with the reference's."""
    result = Comparison(layout)
    missing = [s for s in range(1, steps + 1) if s not in rows or s not in reference]
    if missing:
        result.problem = f"no metrics row for step(s) {missing}"
        return result
    loss_diffs, norm_diffs = [], []
    for step in range(1, steps + 1):
        (loss, norm), (ref_loss, ref_norm) = rows[step], reference[step]
        if None in (loss, norm, ref_loss, ref_norm):
            result.problem = f"non-finite loss or grad_norm at step {step}"
            return result
        loss_diffs.append(relative_diff(loss, ref_loss))  # type: ignore[arg-type]
        norm_diffs.append(relative_diff(norm, ref_norm))  # type: ignore[arg-type]
    result.loss_diff, result.grad_norm_diff = max(loss_diffs), max(norm_diffs)
    return result


def format_table(comparisons: Sequence[Comparison], tolerance: float, steps: int) -> str:
    """The result table, one row per layout, with the difference measure in its header."""
    header = ("layout", "world", "max rel dloss", "max rel dgrad_norm", "result")
    lines = [
        f"rel d = max over steps 1..{steps} of |x - x_ref| / |x_ref| (x_ref: the "
        f"single-process run); PASS when both are <= {tolerance:g}",
    ]
    table: list[tuple[str, ...]] = [header]
    for c in comparisons:
        result = "REFUSED" if c.refused else "PASS" if c.passed(tolerance) else "FAIL"
        diffs = (_number(c.loss_diff), _number(c.grad_norm_diff))
        table.append((c.layout.text, str(c.layout.world_size), *diffs, result))
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        cells = [row[0].ljust(widths[0])]
        cells += [v.rjust(w) for v, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


# torchrun's own lines: its log ("W1203 13:47:08.508000 6004 torch/distributed/run.py:874]
# ...") and its banner about OMP_NUM_THREADS.
_LAUNCHER_LOG = re.compile(
    r"^([DIWEF]\d{4} [\d:.]+ \d+ torch/distributed/|\*+$|Setting OMP_NUM_THREADS environment)"
)


_FAILED_RANK = re.compile(r"^\s*rank\s*: (\d+)")
_FAILED_EXIT = re.compile(r"^\s*exitcode\s*: (-?\d+)")


def output_tail(text: str, lines: int = STDERR_TAIL_LINES) -> str:
    """The last lines of a run's output, indented, without torchrun's own log lines and its
    closing traceback and failure summary, and with repeats (one per rank) shown once, so
    that the ranks' own error is what shows; then one line per rank the summary names with
    its exit code (a rank killed by a signal, say SIGSEGV, prints nothing of its own)."""
    kept = text.strip().splitlines()
    failed: list[str] = []
    for i in range(len(kept) - 1, -1, -1):
        if kept[i] == "Traceback (most recent call last):" and any(
            "ChildFailedError" in line for line in kept[i:]
        ):
            kept, failed = kept[:i], failed_ranks(kept[i:])
            break
    shown: list[str] = []
    for line in kept:
        if not _LAUNCHER_LOG.match(line) and (not shown or line != shown[-1]):
            shown.append(line)
    return "\n".join("    " + line for line in [*shown[-lines:], *failed])


def _ending(code: int) -> str:
    """How a process ended, from its exit code (negative: the signal that killed it)."""
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def failed_ranks(summary: list[str]) -> list[str]:
    """'rank R exited with ...' for each rank torchrun's failure summary names, in its order
    and once each."""
    said: dict[int, str] = {}
    rank = None
    for line in summary:
        if match := _FAILED_RANK.match(line):
            rank = int(match[1])
        elif (match := _FAILED_EXIT.match(line)) and rank is not None:
            said.setdefault(rank, f"rank {rank} ended with {_ending(int(match[1]))} (torchrun)")
            rank = None
    return list(said.values())


@dataclass
class RunOutcome:
    returncode: int
    output_tail: str
    seconds: float


def print_run_line(layout: Layout, status: str, seconds: float) -> None:
    """The one line a finished run of ``layout`` is reported in, however it was launched."""
    processes = f"{layout.world_size} process{'es' if layout.world_size > 1 else ''}"
    print(f"  {layout.text} ({processes}): {status}, {seconds:.1f} s", flush=True)


def run_one(command: list[str], layout: Layout, *, fork: bool = True) -> RunOutcome:
    """Run one training command to its end, report it in one line, and keep the tail of
    what it printed. ``fork``: in a child forked from this process where that is safe
    (launch/forked_command.py), else in a fresh interpreter."""
    started = time.perf_counter()
    proc = run_captured(command, fork=fork)
    seconds = time.perf_counter() - started
    status = "ok" if proc.returncode == 0 else f"exit code {proc.returncode}"
    print_run_line(layout, status, seconds)
    tail = output_tail(proc.stderr) if proc.stderr.strip() else output_tail(proc.stdout)
    return RunOutcome(proc.returncode, tail, seconds)
