"""The bookkeeping of sharded Muon that every rank must agree on without talking: which
indices each rank's shard holds, and which rank orthogonalises which matrix."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from kempnerforge.optim.muon_sharded import deal_owners, newton_schulz_cost, shard_runs


def _torch_shard(
    whole: torch.Tensor, placements: list[Placement], sizes: list[int], coordinate: list[int]
) -> torch.Tensor:
    """The shard DTensor gives the rank at ``coordinate``: each placement, left to right,
    splits what the ones before left (torch's own splitting, as distribute_tensor does)."""
    local = whole
    for placement, parts, index in zip(placements, sizes, coordinate, strict=True):
        if isinstance(placement, Replicate):
            continue
        pieces, _ = placement._split_tensor(local, parts, with_padding=False)  # type: ignore[attr-defined]
        local = pieces[index] if index < len(pieces) else local.narrow(placement.dim, 0, 0)  # type: ignore[attr-defined]
    return local


def _from_runs(whole: torch.Tensor, runs: list[list[tuple[int, int]]]) -> torch.Tensor:
    index = [
        torch.cat([torch.arange(s, s + n) for s, n in r] or [torch.empty(0, dtype=torch.long)])
        for r in runs
    ]
    return whole[index[0][:, None], index[1][None, :]]


LAYOUTS = {
    # FSDP alone, tensor parallelism alone (columns, rows), and FSDP over tensor
    # parallelism as FSDP2 lays it out: _StridedShard on dp_shard when both cut rows.
    "fsdp": ([Shard(0)], [3]),
    "tp_rows": ([Shard(1)], [2]),
    "fsdp_tp_columns": ([_StridedShard(0, split_factor=2), Shard(0)], [2, 2]),
    "fsdp_tp_rows": ([Shard(0), Shard(1)], [2, 2]),
    "hsdp_tp": ([Replicate(), _StridedShard(0, split_factor=4), Shard(0)], [2, 3, 4]),
    "nested": ([Shard(0), Shard(0)], [3, 2]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", [(8, 8), (13, 7), (5, 3), (1, 9), (32, 96)])
def test_shard_runs_name_the_elements_dtensor_puts_on_each_rank(layout, shape):
    """Every coordinate's runs pick out exactly the elements torch's splitting leaves
    there, also when a dimension does not divide (short and empty shards)."""
    placements, sizes = LAYOUTS[layout]
    whole = torch.arange(math.prod(shape)).view(shape)
    for coordinate in itertools.product(*(range(s) for s in sizes)):
        want = _torch_shard(whole, placements, sizes, list(coordinate))
        got = _from_runs(whole, shard_runs(shape, placements, sizes, list(coordinate)))
        assert torch.equal(got, want), (coordinate, got, want)


@pytest.mark.parametrize("matrices", [1, 5, 6, 7, 14, 84])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_each_rank_owns_at_most_its_share_of_the_matrices(matrices, ranks):
    shapes = [(32 * (1 + i % 3), 32) for i in range(matrices)]
    owners = deal_owners(shapes, ranks)
    counts = [owners.count(r) for r in range(ranks)]
    assert sum(counts) == matrices
    assert max(counts) <= math.ceil(matrices / ranks)


def test_big_matrices_spread_over_the_ranks():
    """A block's seven matrices, four square and three 3x wide, over 2 and 4 ranks: the
    busiest rank's Newton-Schulz work is within one big matrix of an even split, where
    dealing in listed order piles the wide ones up."""
    block = [(768, 768)] * 4 + [(2048, 768), (768, 2048), (2048, 768)]
    shapes = block * 12
    cost = [newton_schulz_cost(s) for s in shapes]
    for ranks in (2, 4):
        owners = deal_owners(shapes, ranks)
        loads = [sum(c for c, o in zip(cost, owners, strict=True) if o == r) for r in range(ranks)]
        assert max(loads) - sum(cost) / ranks <= max(cost)
        in_order = [sum(c for i, c in enumerate(cost) if i % ranks == r) for r in range(ranks)]
        assert max(loads) <= max(in_order)


def test_every_rank_deals_alike():
    shapes = [(5, 3), (3, 5), (7, 7), (2, 9)] * 3
    assert deal_owners(shapes, 3) == deal_owners(list(shapes), 3)
