"""model/weight_init.py: shard index sets as torch lays DTensors out, and tiled draws that
give every shard, in any layout, its slice of the unsharded parameter bitwise."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from kempnerforge.model.weight_init import (
    TILE_ELEMENTS,
    copy_full_tensor,
    fill_parameter,
    fill_shard,
    shard_indices,
    tile_rows,
)


def _torch_shard(
    full: torch.Tensor, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements
) -> torch.Tensor:
    """The local tensor distribute_tensor gives the rank at ``coordinate``: each placement's
    own split, left to right."""
    local = full
    for mesh_dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            continue
        shards, _ = placement._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)
        local = shards[coordinate[mesh_dim]]
    return local


def _take(full: torch.Tensor, indices: list[torch.Tensor]) -> torch.Tensor:
    for dim, index in enumerate(indices):
        full = full.index_select(dim, index)
    return full


def _placement_choices(ndim: int) -> list[Placement]:
    choices: list[Placement] = [Replicate()]
    for dim in range(ndim):
        choices += [Shard(dim)]
        choices += [_StridedShard(dim, split_factor=f) for f in (2, 3)]
    return choices


@pytest.mark.parametrize("shape", [(7, 5), (10, 3), (3, 4), (5,), (13, 2, 3)])
@pytest.mark.parametrize("mesh_shape", [(3,), (2, 2), (4, 2)])
def test_shard_indices_are_the_values_distribute_tensor_gives_each_rank(shape, mesh_shape):
    full = torch.arange(torch.Size(shape).numel()).view(shape)
    choices = _placement_choices(len(shape))
    for placements in itertools.product(choices, repeat=len(mesh_shape)):
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            indices = shard_indices(shape, mesh_shape, coordinate, placements)
            want = _torch_shard(full, mesh_shape, coordinate, placements)
            assert torch.equal(_take(full, indices), want), (placements, coordinate)
            # torch's own helper agrees on the shape; its single offset per dim cannot
            # describe a strided shard, which is why the indices are computed here.
            local_shape, _ = _compute_local_shape_and_global_offset(
                shape, mesh_shape, list(coordinate), placements
            )
            assert tuple(local_shape) == tuple(len(i) for i in indices)


def test_a_partial_placement_is_refused():
    from torch.distributed.tensor import Partial

    with pytest.raises(ValueError, match="holds no slice of its full value"):
        shard_indices((4, 4), (2,), (0,), [Partial()])


def test_tiles_hold_whole_rows_of_about_a_million_elements():
    assert tile_rows((4096, 1000)) == TILE_ELEMENTS // 1000
    assert tile_rows((8, 64, 128)) == TILE_ELEMENTS // 128  # rows of the last dim
    assert tile_rows((10, 3 * TILE_ELEMENTS)) == 1  # a row longer than a tile is one tile
    assert tile_rows((5_000_000,)) == TILE_ELEMENTS  # a vector is a column


# Shapes that span several tiles: rows split inside a tile (3001 x 1000: tiles of 1048
# rows), one-row tiles (rows longer than a tile), a 3-d expert stack whose leading dims
# flatten into rows, and a long vector.
MULTI_TILE = [(3001, 1000), (5, TILE_ELEMENTS // 2 + 1), (5, 300, 1400), (2_500_001,)]
LAYOUTS = [
    ((2,), [Shard(0)]),
    ((3,), [Shard(0)]),
    ((2,), [Shard(1)]),
    ((2, 2), [Shard(0), Shard(1)]),  # FSDP over row-wise tensor parallelism
    ((2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),  # FSDP over column-wise TP
    ((4, 2), [_StridedShard(0, split_factor=2), Shard(0)]),
    ((2, 3), [Replicate(), Shard(0)]),  # HSDP
]


@pytest.mark.parametrize("shape", MULTI_TILE, ids=str)
def test_every_shard_of_a_multi_tile_parameter_is_its_slice_of_the_unsharded_draw(shape):
    whole = torch.empty(shape)
    fill_parameter(whole, 0.02, seed=11)
    assert whole.std().item() == pytest.approx(0.02, rel=0.01)
    for mesh_shape, placements in LAYOUTS:
        placements = [p for p in placements if not isinstance(p, Shard) or p.dim < len(shape)]
        if len(placements) < len(mesh_shape):
            continue
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            indices = shard_indices(shape, mesh_shape, coordinate, placements)
            shard = torch.empty(tuple(len(i) for i in indices))
            fill_shard(shard, shape, indices, 0.02, seed=11)
            assert torch.equal(shard, _take(whole, indices)), (placements, coordinate)


def test_the_draw_depends_on_the_seed_and_every_tile_differs():
    first, again, other = (torch.empty(3001, 1000) for _ in range(3))
    fill_parameter(first, 1.0, seed=5)
    fill_parameter(again, 1.0, seed=5)
    fill_parameter(other, 1.0, seed=6)
    assert torch.equal(first, again) and not torch.equal(first, other)
    rows = tile_rows(first.shape)
    assert not torch.equal(first[:rows], first[rows : 2 * rows])  # tiles use their own seeds


def test_a_non_contiguous_shard_is_filled_in_place():
    whole = torch.empty(40, 6)
    fill_parameter(whole, 1.0, seed=2)
    transposed = torch.empty(6, 40).t()
    fill_parameter(transposed, 1.0, seed=2)
    assert torch.equal(transposed, whole)


def test_norm_gains_are_ones_and_a_full_value_copies_into_a_plain_tensor():
    gain = torch.zeros(8)
    fill_parameter(gain, None, seed=0)
    assert torch.equal(gain, torch.ones(8))
    target = torch.zeros(3, 4, dtype=torch.bfloat16)
    copy_full_tensor(target, torch.arange(12.0).view(3, 4))
    assert torch.equal(target, torch.arange(12.0).view(3, 4).bfloat16())
    with pytest.raises(ValueError, match=r"shape \(4, 3\) for a \(3, 4\) tensor"):
        copy_full_tensor(target, torch.zeros(4, 3))
