"""Process groups and per-step collectives of a real two-rank run with async checkpoints.

Every group a run creates is one of its mesh's or the runtime's one side group (none is
the checkpoint manager's); while a background save is in flight, a step issues exactly one
collective over the whole world from the main thread: the step's own vote, which also
tells the checkpoint manager whether every rank's write is done.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kempnerforge.checkpoint.background import FAULT_SAVE_DELAY_ENV
from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.training.build import build_session
from kempnerforge.training.hooks import StepContext, TrainingHook
from kempnerforge.training.loop import run_training_loop
from tests.support.dist import run_distributed
from tests.support.tiny import tiny_run

pytestmark = pytest.mark.distributed

COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "all_gather",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "gather",
    "scatter",
)
"""The torch.distributed calls the framework and DCP issue by name (tensor parallelism's
own collectives are functional ones, which a layout with tp = 2 leaves out of the count)."""


STEP_PAUSE_S = 0.4
"""Added to every step, so a background write held for FAULT_DELAY_S spans a few steps."""
FAULT_DELAY_S = 2.0


class _Steps(TrainingHook):
    """Cuts the main thread's collectives into one window per step: ``windows[i]`` holds
    what ran from step i's end to step i + 1's end (step i's poll and save, then step
    i + 1), and whether a save was in flight at its end. ``committed`` holds the index of
    the window each commit ran in."""

    def __init__(self, calls: list[tuple[str, str]], session: Any) -> None:
        self.calls, self.session = calls, session
        self.windows: list[dict[str, Any]] = []
        self.committed: list[int] = []
        self._start = 0

    def on_step_end(self, ctx: StepContext) -> None:
        in_flight = self.session.checkpointer.pending_step is not None
        calls = self.calls[self._start :]
        self._start = len(self.calls)
        self.windows.append({"step": ctx.step, "calls": calls, "in_flight": in_flight})
        time.sleep(STEP_PAUSE_S)

    def on_checkpoint_save(self, step: int, path: str) -> None:
        self.committed.append(len(self.windows))


def _counted_run(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    # Each background save stays in flight for a few steps.
    os.environ[FAULT_SAVE_DELAY_ENV] = str(FAULT_DELAY_S)
    config = load_config(None, overrides)
    config.validate(world_size)
    before = set(c10d._world.pg_map)
    runtime = init_runtime(config.distributed, "cpu")
    after_init = set(c10d._world.pg_map)
    session = build_session(config, runtime)

    calls: list[tuple[str, str]] = []
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str):
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is threading.main_thread():
                group = kwargs.get("group")
                if group is None and name in ("all_reduce", "barrier", "monitored_barrier"):
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                size = dist.get_world_size(group)
                # The vocabulary-parallel loss's reductions over tp are the model's, not
                # the loop's: named apart (here the tp group spans the world).
                caller = sys._getframe(1).f_code.co_filename
                where = "side" if group is runtime.side_group else "other"
                if caller.endswith("vocab_parallel_loss.py"):
                    where = "tp"
                calls.append((name, where if size == world_size or where == "tp" else "part"))
            return real[name](*args, **kwargs)

        return call

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    steps = _Steps(calls, session)
    session.hooks.add(steps)
    saves: list[int] = []
    real_save = session.checkpointer.save

    def save(step: int, **kwargs: Any) -> str:
        saves.append(len(steps.windows))
        return real_save(step, **kwargs)

    session.checkpointer.save = save  # type: ignore[method-assign]
    with session.tracker:
        run_training_loop(session)
    for name, fn in real.items():
        setattr(dist, name, fn)
    mesh = set(runtime.device_mesh.get_all_groups()) | {runtime.dp_mesh.get_group()}
    return {
        "created_by_init": {
            "mesh": len((after_init - before) & mesh),
            "side": runtime.side_group in after_init - before,
            "other": len((after_init - before) - mesh - {runtime.side_group}),
        },
        "created_after_init": len(set(c10d._world.pg_map) - after_init),
        "windows": steps.windows,
        "saves": saves,
        "commits": steps.committed,
        "mesh_groups_new": len(mesh - before),
    }


def test_one_side_group_and_one_world_collective_per_step_during_an_async_save(
    tmp_path, token_dirs
):
    overrides = tiny_run(
        tmp_path / "run",
        token_dirs,
        "--model.n_kv_heads=2",
        "--train.max_steps=20",
        "--scheduler.warmup_steps=1",
        "--metrics.log_interval=10",
        "--eval.interval=0",
        "--checkpoint.interval=10",
        "--checkpoint.async_mode=async",
        "--distributed.tp=2",
        "--distributed.dp_shard=1",
        "--data.document_masking=false",
    )
    ranks = run_distributed(_counted_run, 2, overrides)
    for record in ranks:
        created = record["created_by_init"]
        assert created == {"mesh": record["mesh_groups_new"], "side": True, "other": 0}
        assert record["created_after_init"] == 0  # the checkpoint manager made none
        windows, saves = record["windows"], record["saves"]
        assert saves == [10, 20]  # the saves of steps 10 and 20
        # Steps 12 to 14 run while step 10's write is held: each issues the step's vote only.
        for window in windows[11:14]:
            loop_calls = [c for c in window["calls"] if c[1] != "tp"]
            assert window["in_flight"] and loop_calls == [("all_reduce", "other")], window
        # The poll that finds every write done commits on the vote alone: the commit's own
        # agreement and rank 0's broadcast, then the next step's vote.
        [by_poll, at_end] = record["commits"]
        assert 14 <= by_poll < 20 and at_end == len(windows)
        assert [c for c in windows[by_poll]["calls"] if c[1] != "tp"] == [
            ("all_reduce", "other"),
            ("broadcast_object_list", "other"),
            ("all_reduce", "other"),
        ]
        assert not [c for w in windows for c in w["calls"] if c[1] == "side"]
    assert ranks[0]["windows"] == ranks[1]["windows"]
