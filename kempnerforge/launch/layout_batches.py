"""check-parallel's batches: the layouts of one world size trained by one torchrun launch.

A launch per layout spends most of its time starting processes (torch's imports, the
launcher, the process group) before a few steps of a small model; on a sweep of many
layouts that start-up is most of the check. A batch starts the processes once and trains
its layouts one after another in them (commands/layout_batch.py), each run still the
train command's own code with its own mesh, model, data and seed. A layout's numbers
cannot depend on the runs before it: each run builds everything from the config and the
seed. Whatever a batch did not finish (a run that failed, the runs after it) goes back to
a launch of its own, so a failure is always reported from a launch of its own.
Importing this module stays light (no torch), like the rest of the CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Sequence

from kempnerforge.launch.forked_command import run_captured
from kempnerforge.launch.parallel_check import Layout, RunOutcome, output_tail, print_run_line

BATCH_MODULE = "kempnerforge.commands.layout_batch"
DONE_SUFFIX = ".done"
"""commands/layout_batch.py's record of the runs it finished: the plan's path + this."""


def batches(layouts: Sequence[Layout]) -> list[list[Layout]]:
    """The layouts grouped by world size, in the order their first layout was named; a
    world size with one layout is no batch (one launch either way)."""
    by_world: dict[int, list[Layout]] = {}
    for layout in layouts:
        by_world.setdefault(layout.world_size, []).append(layout)
    return [group for group in by_world.values() if len(group) > 1]


def batch_command(plan_path: str, world_size: int) -> list[str]:
    """The torchrun command line of one batch."""
    torchrun = ["torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}"]
    return [sys.executable, "-m", *torchrun, "-m", BATCH_MODULE, plan_path]


def run_batch(
    config: str,
    layouts: Sequence[Layout],
    run_args: Callable[[Layout], list[str]],
    run_dirs: dict[Layout, str],
    work_dir: str,
    *,
    fork: bool = True,
) -> dict[Layout, RunOutcome]:
    """Train ``layouts`` (one world size) in one launch; the outcome of each layout the
    launch finished. The run directories of the others are removed, ready for a launch of
    their own. ``fork``: the launcher in a child forked from this process where that is
    safe (launch/forked_command.py); its ranks are fresh interpreters either way."""
    world_size = layouts[0].world_size
    plan_path = os.path.join(work_dir, f"batch_{world_size}.json")
    plan = [{"config": config, "overrides": run_args(layout)} for layout in layouts]
    with open(plan_path, "w") as f:
        json.dump({"runs": plan}, f)
    with contextlib.suppress(FileNotFoundError):  # a done file of an earlier check
        os.remove(plan_path + DONE_SUFFIX)
    names = ", ".join(layout.text for layout in layouts)
    print(f"  one launch of {world_size} processes for {len(layouts)} layouts: {names}", flush=True)
    started = time.perf_counter()
    proc = run_captured(batch_command(plan_path, world_size), fork=fork)
    done = _finished_runs(plan_path + DONE_SUFFIX)
    outcomes: dict[Layout, RunOutcome] = {}
    for index, layout in enumerate(layouts):
        if index in done:
            print_run_line(layout, "ok", done[index])
            outcomes[layout] = RunOutcome(0, "", done[index])
        else:
            shutil.rmtree(run_dirs[layout], ignore_errors=True)
    if len(outcomes) < len(layouts):
        stopped = layouts[len(outcomes)].text if proc.returncode else "?"
        tail = output_tail(proc.stderr if proc.stderr.strip() else proc.stdout, lines=5)
        print(
            f"  the launch ended at {stopped} (exit code {proc.returncode}) after "
            f"{time.perf_counter() - started:.1f} s; it and the layouts after it run one "
            f"launch each:\n{tail}",
            flush=True,
        )
    return outcomes


def _finished_runs(path: str) -> dict[int, float]:
    """{run index: seconds} of the runs a batch finished on every rank."""
    if not os.path.exists(path):
        return {}
    finished = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                finished[int(row["index"])] = float(row["seconds"])
    return finished
