"""A rank of 1,024 builds and steps at the cost of its own share: counted in a simulated world.

tests/support/world_sim.py runs the real start-up, build and training loop of one rank in
a world of fake peers (HSDP x TP: dp_replicate x dp_shard x tp), recording every process
group and every collective. The same rank in a world of 128 must do exactly the same: the
world size may change the number of groups torch's mesh creates around the rank, never
what the rank joins or sends each step.
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.support.world_sim import SimulationReport, run_simulation

MODEL = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=8",
    "--model.n_kv_heads=8",
    "--model.vocab_size=512",
    "--model.multiple_of=16",
    "--model.max_seq_len=64",
    "--train.seq_len=32",
    "--train.batch_size=1",
    "--train.grad_accum_steps=2",
    "--checkpoint.interval=0",
    "--eval.interval=0",
]
LAYOUTS = {128: (2, 8, 8), 1024: (16, 8, 8)}
"""World size -> (dp_replicate, dp_shard, tp)."""


def _simulate(world_size: int, rank: int, tmp_path) -> SimulationReport:
    replicate, shard, tp = LAYOUTS[world_size]
    layout = [
        f"--distributed.dp_replicate={replicate}",
        f"--distributed.dp_shard={shard}",
        f"--distributed.tp={tp}",
    ]
    return run_simulation([*MODEL, *layout], rank, world_size, 3, str(tmp_path / str(world_size)))


def _per_step(report: SimulationReport) -> list[Counter[tuple[str, int]]]:
    return [Counter((c.op, c.group_size) for c in step) for step in report.steps]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[int, SimulationReport]:
    tmp = tmp_path_factory.mktemp("world")
    return {world: _simulate(world, world - 3, tmp) for world in LAYOUTS}


def test_a_rank_joins_its_mesh_groups_and_one_world_wide_side_group(reports):
    big = reports[1024]
    # default, pp, dp_replicate, dp_shard, tp, the flattened dp, the side group
    assert big.groups_joined == 7
    assert big.world_groups == 2  # the default group and the side group, nothing else
    assert reports[128].world_groups == 2


def test_each_step_issues_one_world_wide_collective_the_vote(reports):
    for report in reports.values():
        assert report.per_step_world_collectives() == [1, 1, 1]
        for step in report.steps:
            (vote,) = [c for c in step if c.group_size == report.world_size]
            assert vote.op == "allreduce_" and vote.num_bytes <= 16  # two flags


def test_a_step_sends_the_same_whatever_the_world_size(reports):
    small, big = reports[128], reports[1024]
    assert len(big.steps) == len(small.steps) == 3
    for step_small, step_big in zip(small.steps, big.steps, strict=True):
        # The same collectives with the same payloads; only the sizes of the groups that
        # span the replicas (dp_replicate, the flattened dp, the world) differ.
        assert [(c.op, c.num_bytes) for c in step_small] == [(c.op, c.num_bytes) for c in step_big]
    sizes = {c.group_size for step in big.steps for c in step}
    assert sizes == {8, 16, 128, 1024}  # dp_shard and tp, dp_replicate, dp, the vote
    assert _per_step(big)[0] == _per_step(big)[2]  # every step alike
