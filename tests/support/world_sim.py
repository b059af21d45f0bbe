"""One rank of a large job, simulated in one process: what it creates and what a step sends.

torch's fake process group (torch.testing) stands in for every other rank: collectives
return at once with their outputs untouched, so one process runs the real start-up
(init_runtime: the device mesh, the side group), the real build (build_session) and the
real training loop of rank ``rank`` in a world of ``world_size``, on a model small enough
for a CPU but sharded exactly as the configured layout shards it. The numbers it trains
on are meaningless; what it counts is not: the process groups this rank creates and joins,
and every collective each step issues, with the size of its group and its payload.

Call ``simulate_rank`` in a fresh process (``run_simulation`` does): the fake world is the
process's default group for the rest of its life.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CollectiveCall:
    """One collective as a rank issued it: the op, its group's size and name, its payload."""

    op: str
    group_size: int
    group: str
    num_bytes: int


@dataclass
class SimulationReport:
    """What one simulated rank did: start-up and the collectives of each step."""

    world_size: int
    rank: int
    groups_joined: int
    """Process groups this rank is a member of after start-up (default group included)."""
    world_groups: int
    """Of those, how many span the whole world (the default group included)."""
    new_group_calls: int
    """Calls of torch.distributed.new_group during start-up, member or not."""
    group_roles: dict[str, str] = field(default_factory=dict)
    """Group name -> what it is ('world', 'side', or a mesh dimension: 'tp', 'dp', ...)."""
    build_collectives: list[CollectiveCall] = field(default_factory=list)
    steps: list[list[CollectiveCall]] = field(default_factory=list)
    """Per optimizer step, every collective in issue order."""

    def per_step_world_collectives(self) -> list[int]:
        return [sum(c.group_size == self.world_size for c in step) for step in self.steps]


def _group_of(arg: Any) -> tuple[int, str] | None:
    """(size, name) of a process group an op argument names (an object or a group name)."""
    if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
        group = dist.ProcessGroup.unbox(arg)  # how the eager c10d ops carry their group
    elif isinstance(arg, dist.ProcessGroup):
        group = arg
    elif isinstance(arg, str):
        try:
            group = dist.distributed_c10d._resolve_process_group(arg)  # type: ignore[arg-type]
        except Exception:
            return None
    else:
        return None
    return group.size(), str(group.group_name)


def _payload_bytes(args: tuple[Any, ...]) -> int:
    total = 0
    for arg in args:
        items = arg if isinstance(arg, list | tuple) else [arg]
        for item in items:
            if isinstance(item, torch.Tensor):
                total += item.numel() * item.element_size()
    return total


class CollectiveRecorder(TorchDispatchMode):
    """Records every c10d collective dispatched while it is active (eager ops, DTensor's
    functional collectives and FSDP's), with its group and the bytes of its tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[CollectiveCall] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
            name = func._schema.name.split("::")[-1]
            if not name.startswith(("wait", "_wait")):
                group = next(
                    (g for g in map(_group_of, [*args, *(kwargs or {}).values()]) if g), None
                )
                if group is not None:
                    self.calls.append(
                        CollectiveCall(name, group[0], group[1], _payload_bytes(args))
                    )
        return func(*args, **(kwargs or {}))


def start_fake_world(rank: int, world_size: int) -> Counter[str]:
    """Join a fake world of ``world_size`` ranks as ``rank``; counts new_group calls.

    A gloo group cannot be created over the fake store, so a group asked for with
    ``backend="gloo"`` (the side group) is made with the fake backend instead: it still
    counts, spans the same ranks and takes part in the same collectives.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    counts: Counter[str] = Counter()
    real_new_group = dist.distributed_c10d.new_group

    def new_group(*args: Any, backend: Any = None, **kwargs: Any) -> Any:
        counts["new_group"] += 1
        return real_new_group(*args, **kwargs)

    dist.new_group = new_group  # type: ignore[assignment]
    dist.distributed_c10d.new_group = new_group  # type: ignore[assignment]
    import torch.distributed.device_mesh as device_mesh

    device_mesh.new_group = new_group  # type: ignore[attr-defined]
    return counts


def _group_roles(runtime: Any) -> dict[str, str]:
    """Name -> role of every group the rank can send on; a dimension of size 1 has none."""
    roles = {str(dist.group.WORLD.group_name): "world"}  # type: ignore[union-attr]
    for dim in ("pp", "dp_replicate", "dp_shard", "tp", "dp", "ep", "efsdp"):
        group = runtime.group(dim)
        if group is not None:
            roles.setdefault(str(group.group_name), dim)
    if runtime.side_group is not None:
        roles[str(runtime.side_group.group_name)] = "side"
    return roles


def _tiny_corpus(root: Path, num_windows: int, seq_len: int) -> str:
    """A prepared corpus of at least ``num_windows`` windows of ``seq_len`` byte tokens."""
    from kempnerforge.data.prepare.corpus import prepare_data
    from kempnerforge.data.tokenizer import ByteTokenizer

    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import"]
    num_words = (num_windows + 2) * seq_len // 5 + 1
    source = root / "docs.txt"
    source.write_text(" ".join(words[i % len(words)] for i in range(num_words)))
    prepare_data([str(source)], str(root / "corpus"), ByteTokenizer())
    return str(root / "corpus")


def simulate_rank(
    overrides: list[str], rank: int, world_size: int, steps: int, workdir: str
) -> SimulationReport:
    """Start, build and train ``steps`` steps as rank ``rank`` of ``world_size``; the report.

    ``overrides`` set the model and layout (``--distributed.*``); the run directory, data,
    step count and a quiet tracker are set here. Eval runs as configured; checkpoints are
    not saved (see below), so keep ``checkpoint.interval`` at 0.
    """
    from kempnerforge.config.loader import load_config
    from kempnerforge.distributed.runtime import init_runtime
    from kempnerforge.training.build import build_session
    from kempnerforge.training.loop import run_training_loop

    torch.set_num_threads(1)
    counts = start_fake_world(rank, world_size)
    root = Path(workdir)
    root.mkdir(parents=True, exist_ok=True)
    config = load_config(None, overrides)
    seq_len, batch = config.train.seq_len, config.train.batch_size
    dp = world_size // (config.distributed.tp * config.distributed.pp)
    corpus = _tiny_corpus(root, dp * batch * config.train.grad_accum_steps * (steps + 1), seq_len)
    config = load_config(
        None,
        [
            *overrides,
            f"--data.path={corpus}",
            "--data.eval_path=",
            f"--train.max_steps={steps}",
            f"--train.run_dir={root / 'run'}",
            "--train.sample_prompt=",
            "--metrics.progress=off",
            "--metrics.log_interval=1",
        ],
    )
    config.validate(world_size)
    before = set(dist.distributed_c10d._world.pg_map)
    runtime = init_runtime(config.distributed, "cpu")
    groups = [
        dist.group.WORLD,
        *(g for g in dist.distributed_c10d._world.pg_map if g not in before),
    ]
    report = SimulationReport(
        world_size=world_size,
        rank=rank,
        groups_joined=len(groups),
        world_groups=sum(g.size() == world_size for g in groups),  # type: ignore[union-attr]
        new_group_calls=counts["new_group"],
        group_roles=_group_roles(runtime),
    )
    recorder = CollectiveRecorder()
    starts: list[int] = []
    with recorder:
        session = build_session(config, runtime)
        report.build_collectives = list(recorder.calls)
        # A save's collectives exchange pickled objects, which the fake peers cannot
        # answer: the end-of-run save is left out (tests/scale/test_checkpoint_files.py
        # counts what a save and a resume cost a rank).
        session.checkpointer.save = lambda step, **_: ""  # type: ignore[method-assign]
        step_fn = session.step_fn

        def counted_step(session_: Any, step: int) -> Any:
            starts.append(len(recorder.calls))
            return step_fn(session_, step)

        session.step_fn = counted_step
        begin = len(recorder.calls)
        run_training_loop(session)
    # A step is its body and what the loop issues after it, up to the next body (the
    # checkpoint poll, eval, a save); what comes before the first body (the first stop
    # vote) belongs to start-up.
    report.build_collectives += recorder.calls[begin : starts[0]]
    ends = [*starts[1:], len(recorder.calls)]
    report.steps = [recorder.calls[a:b] for a, b in zip(starts, ends, strict=True)]
    return report


@dataclass
class ShardReport:
    """What rank ``rank``'s shards of a model hold, from the real build on the meta device."""

    world_size: int
    rank: int
    num_local_elements: int
    """Elements of this rank's parameter shards (tied parameters once)."""
    largest_tile_elements: int
    """The largest draw tile among its parameters (weight_init): the most init allocates
    beyond the shards."""


def shard_rank(
    overrides: list[str], rank: int, world_size: int, config_path: str | None = None
) -> ShardReport:
    """Shard a model as rank ``rank`` of ``world_size`` would (build_rank_on_meta) and
    measure its shards; nothing is allocated, so any model size works."""
    from torch.distributed.tensor import DTensor

    from kempnerforge.config.loader import load_config
    from kempnerforge.distributed.runtime import init_runtime
    from kempnerforge.model.weight_init import matrix_shape, tile_rows
    from kempnerforge.training.build import build_rank_on_meta

    start_fake_world(rank, world_size)
    config = load_config(config_path, overrides)
    config.validate(world_size)
    runtime = init_runtime(config.distributed, "cpu")
    model = build_rank_on_meta(config, runtime).model
    local = largest_tile = 0
    for param in model.parameters():  # each tied parameter once
        local += (param.to_local() if isinstance(param, DTensor) else param).numel()
        largest_tile = max(largest_tile, tile_rows(param.shape) * matrix_shape(param.shape)[1])
    return ShardReport(world_size, rank, local, largest_tile)


def run_simulation(
    overrides: list[str], rank: int, world_size: int, steps: int, workdir: str
) -> SimulationReport:
    """``simulate_rank`` in a fresh Python process (the fake world cannot be left)."""
    data = _in_fresh_process("simulate_rank", [overrides, rank, world_size, steps, workdir])
    steps_calls = [[CollectiveCall(**c) for c in step] for step in data.pop("steps")]
    build = [CollectiveCall(**c) for c in data.pop("build_collectives")]
    return SimulationReport(**data, build_collectives=build, steps=steps_calls)


def run_shard_rank(
    overrides: list[str], rank: int, world_size: int, config_path: str | None = None
) -> ShardReport:
    """``shard_rank`` in a fresh Python process."""
    arguments = [overrides, rank, world_size, config_path]
    return ShardReport(**_in_fresh_process("shard_rank", arguments))


def _in_fresh_process(function: str, args: list[Any]) -> dict[str, Any]:
    payload = json.dumps([function, args])
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.world_sim", payload],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if result.returncode != 0:
        raise RuntimeError(f"the simulated rank failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    name, arguments = json.loads(sys.argv[1])
    functions = {"simulate_rank": simulate_rank, "shard_rank": shard_rank}
    outcome = functions[name](*arguments)
    sys.stdout.write("\n" + json.dumps(asdict(outcome)) + "\n")
    sys.stdout.flush()
    os._exit(0)  # the fake world has nothing to tear down
