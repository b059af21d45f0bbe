"""The bookkeeping of sharded Muon that every rank must agree on without talking: how
DTensor splits a dimension, and which rank orthogonalises which matrix."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Shard

from kempnerforge.optim.muon_sharded import owner_of, shard_sizes


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 7, 8, 9, 13])
def test_shard_sizes_are_dtensors_split(size, parts):
    pieces, _ = Shard(0)._split_tensor(torch.empty(size, 2), parts, with_padding=False)
    assert shard_sizes(size, parts) == [p.size(0) for p in pieces]


@pytest.mark.parametrize("matrices", [1, 5, 6, 7])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_owners_take_turns(matrices, ranks):
    owners = [owner_of(i, ranks) for i in range(matrices)]
    counts = [owners.count(r) for r in range(ranks)]
    assert sum(counts) == matrices
    assert max(counts) <= math.ceil(matrices / ranks)
