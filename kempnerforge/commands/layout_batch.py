"""The processes of one check-parallel batch: the layouts of one world size trained one
after another by a single torchrun launch, each exactly as `kempnerforge train` trains it.

`kempnerforge check-parallel` starts this module under torchrun with a plan file (written
by launch/layout_batches.py) naming each run's config, overrides and run directory. Each
run goes through the train command's own code (``run_train``: validation, build, resume
plan, the loop, the end-of-run teardown); what the runs share is the process, its imports
and the world process group, which one process can join only once
(distributed/runtime.py runs_sharing_the_world_group). Each run makes its own mesh groups,
model, optimizer, data and seeds, and leaves its groups when it ends.

After a run ends with exit code 0 on every rank, rank 0 records it in the plan's done file
(one JSON line: its index and seconds), which is how check-parallel learns which runs this
launch finished. A run that fails, on any rank, ends the whole launch at once (the rank
leaves with the run's exit code and torchrun stops its peers); check-parallel then runs it
and the runs after it one launch each, so a failure is reported from a launch of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

from kempnerforge.commands.train import run_train
from kempnerforge.resilience import exit_codes

DONE_SUFFIX = ".done"
"""The done file is the plan file's path with this suffix."""


def main(argv: list[str] | None = None) -> None:
    """Train every run of the plan file ``argv[0]`` in turn; leaves the process."""
    import torch.distributed as dist

    from kempnerforge.distributed.runtime import runs_sharing_the_world_group

    (plan_path,) = sys.argv[1:] if argv is None else argv
    with open(plan_path) as f:
        runs = json.load(f)["runs"]
    rank = int(os.environ.get("RANK", "0"))
    with runs_sharing_the_world_group():
        for index, run in enumerate(runs):
            started = time.perf_counter()
            code = _train(run["config"], run["overrides"])
            if code != exit_codes.FINISHED:
                exit_codes.exit_now(code)
            dist.barrier()  # every rank finished this run
            if rank == 0:
                seconds = time.perf_counter() - started
                with open(plan_path + DONE_SUFFIX, "a") as f:
                    f.write(json.dumps({"index": index, "seconds": round(seconds, 3)}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    exit_codes.exit_now(exit_codes.FINISHED)


def _train(config: str, overrides: list[str]) -> int:
    """One run, as the train command runs it; its exit code, its error reported in the
    command's one line (or with its traceback where the command would show one)."""
    try:
        return run_train(argparse.Namespace(config=config), overrides)
    except BaseException as error:
        code = exit_codes.print_report(error)
        if code is None:
            traceback.print_exc()
            return exit_codes.FAILED
        return code


if __name__ == "__main__":
    main()
