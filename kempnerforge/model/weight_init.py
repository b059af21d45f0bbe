"""Seeded parameter values that a rank computes for its own shard only.

A parameter of shape (..., cols) is seen as a matrix of prod(leading dims) rows and ``cols``
columns (a vector as one column, a scalar as one element). Its normal draw is made in tiles
of whole rows, TILE_ELEMENTS elements or one row, whichever is more: the tile size depends
only on the shape, and each tile has its own generator, seeded by the parameter's seed and
the tile's index. A shard (the local tensor of a DTensor, whatever its placements) draws
just the tiles its rows overlap and keeps its rows and columns of them, so every layout
holds the same values bitwise while a rank allocates one tile plus its shard, never the
whole parameter.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from kempnerforge.config.model import ModelConfig

TILE_ELEMENTS = 1 << 20
"""Elements per draw tile (4 MiB in fp32), rounded to whole rows; part of what the values
are, so changing it changes every initial weight."""


def parameter_seed(seed: int, name: str) -> int:
    """A generator seed for parameter ``name`` of a model initialised with ``seed``."""
    return _hash_seed(f"kempnerforge-init:{seed}:{name}")


def tile_seed(param_seed: int, tile: int) -> int:
    """The generator seed of tile ``tile`` of the parameter seeded with ``param_seed``."""
    return _hash_seed(f"kempnerforge-tile:{param_seed}:{tile}")


def _hash_seed(text: str) -> int:
    digest = hashlib.sha256(text.encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """(rows, columns) of the matrix a parameter of ``shape`` is drawn as."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], 1
    return math.prod(shape[:-1]), shape[-1]


def tile_rows(shape: Sequence[int]) -> int:
    """Rows per draw tile of a parameter of ``shape``: TILE_ELEMENTS elements, at least a row."""
    return max(1, TILE_ELEMENTS // max(1, matrix_shape(shape)[1]))


def shard_indices(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
    placements: Sequence[Placement],
) -> list[torch.Tensor]:
    """The global indices, per dim, of the shard a rank at ``coordinate`` of a mesh of
    ``mesh_shape`` holds of a tensor of ``shape`` laid out by ``placements``.

    The shard is the product of these index lists, in order. Placements apply left to
    right, as distribute_tensor does: Shard(d) keeps the rank's torch.chunk of dim d (the
    last chunks empty when the dim is short), _StridedShard(d, sf) first chunks dim d into
    sf pieces and keeps the rank's chunk of each (FSDP over an already sharded dim), and
    Replicate keeps everything. torch's compute_local_shape_and_global_offset gives only
    each dim's first index, which cannot describe a strided shard; this gives them all.
    """
    indices = [torch.arange(size) for size in shape]
    for mesh_dim, placement in enumerate(placements):
        count, rank = mesh_shape[mesh_dim], coordinate[mesh_dim]
        if isinstance(placement, _StridedShard):
            pieces = _chunks(indices[placement.dim], int(placement.split_factor))
            indices[placement.dim] = torch.cat([_chunk(p, count, rank) for p in pieces])
        elif isinstance(placement, Shard):
            indices[placement.dim] = _chunk(indices[placement.dim], count, rank)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"a parameter placed as {placement} on mesh dim {mesh_dim} holds no slice of "
                "its full value; only Shard, _StridedShard and Replicate placements do"
            )
    return indices


def _chunk(index: torch.Tensor, count: int, rank: int) -> torch.Tensor:
    """Chunk ``rank`` of torch.chunk(index, count), empty past the last chunk."""
    size = -(-len(index) // count)
    return index[min(rank * size, len(index)) : min((rank + 1) * size, len(index))]


def _chunks(index: torch.Tensor, count: int) -> list[torch.Tensor]:
    return [_chunk(index, count, rank) for rank in range(count)]


def local_indices(param: torch.Tensor) -> list[torch.Tensor]:
    """The global indices, per dim, of the values ``param`` holds here: every index of a
    plain tensor, this rank's shard of a DTensor (empty lists off its mesh)."""
    if not isinstance(param, DTensor):
        return [torch.arange(size) for size in param.shape]
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return [torch.arange(0) for _ in param.shape]
    return shard_indices(param.shape, mesh.shape, coordinate, param.placements)


def _local(param: torch.Tensor) -> torch.Tensor:
    return param.to_local() if isinstance(param, DTensor) else param


@torch.no_grad()
def fill_parameter(
    param: torch.Tensor, std: float | None, seed: int, *, constant: float = 1.0
) -> None:
    """Fill ``param`` with normal(0, std), drawn tile by tile from generators derived from
    ``seed`` (with ``constant`` when std is None: 1 for a norm gain, 0 for a zero-centred
    one; zeros when std is 0); a DTensor draws only the tiles of its own shard, so it holds
    its slice of the values the unsharded parameter gets."""
    local = _local(param)
    if std is None:
        local.fill_(constant)
        return
    if std == 0.0:  # biases and sinks start at zero
        local.zero_()
        return
    fill_shard(local, param.shape, local_indices(param), std, seed)


@torch.no_grad()
def fill_shard(
    shard: torch.Tensor,
    shape: Sequence[int],
    indices: list[torch.Tensor],
    std: float,
    seed: int,
) -> None:
    """Fill ``shard``, the part at ``indices`` (per dim, as local_indices gives them) of a
    parameter of ``shape``, with its values of the parameter's normal(0, std) draw."""
    if tuple(len(i) for i in indices) != tuple(shard.shape):
        raise AssertionError(
            f"shard of shape {tuple(shard.shape)} but its indices give "
            f"{tuple(len(i) for i in indices)}"
        )
    if shard.numel() == 0:
        return
    out = shard if shard.is_contiguous() else torch.empty_like(shard)
    rows, cols = _matrix_indices(shape, indices)
    _draw_rows(out.view(len(rows), len(cols)), shape, rows, cols, std, seed)
    if out is not shard:
        shard.copy_(out)


def _matrix_indices(
    shape: Sequence[int], indices: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shard's (row, column) indices in the parameter's matrix view, rows in the
    shard's own order (ascending when every dim's indices are)."""
    if len(shape) == 0:
        return torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    if len(shape) == 1:
        return indices[0], torch.zeros(1, dtype=torch.long)
    rows = indices[0]
    for size, index in zip(shape[1:-1], indices[1:-1], strict=True):
        rows = (rows[:, None] * size + index[None, :]).reshape(-1)
    return rows, indices[-1]


def _draw_rows(
    out: torch.Tensor,
    shape: Sequence[int],
    rows: torch.Tensor,
    cols: torch.Tensor,
    std: float,
    seed: int,
) -> None:
    """out[i, j] = value (rows[i], cols[j]) of the parameter's matrix, tile by tile."""
    num_rows, num_cols = matrix_shape(shape)
    per_tile = tile_rows(shape)
    all_cols = len(cols) == num_cols  # indices are ascending, so this is every column
    col_index = cols.to(out.device)
    tiles, counts = torch.unique_consecutive(rows // per_tile, return_counts=True)
    start = 0
    for tile, count in zip(tiles.tolist(), counts.tolist(), strict=True):
        first = tile * per_tile
        generator = torch.Generator(device=out.device).manual_seed(tile_seed(seed, tile))
        block = torch.empty(
            (min(per_tile, num_rows - first), num_cols), dtype=out.dtype, device=out.device
        )
        block.normal_(0.0, std, generator=generator)
        wanted = rows[start : start + count] - first
        if int(wanted[-1] - wanted[0]) == count - 1:  # consecutive rows: a view, no copy
            block = block[int(wanted[0]) : int(wanted[0]) + count]
        else:
            block = block.index_select(0, wanted.to(out.device))
        out[start : start + count] = block if all_cols else block.index_select(1, col_index)
        start += count


def zero_parameter(param: torch.Tensor) -> None:
    """Set ``param`` (or, for a DTensor, this rank's shard of it) to zeros."""
    _local(param).zero_()


@torch.no_grad()
def copy_full_tensor(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the whole-model value ``full`` into ``param``: a DTensor keeps its own shard.

    ``full`` must have param's full shape; the shard is cut from it where it lies (a
    checkpoint's tensor in host memory), then cast to the parameter's dtype and moved to
    its device, so only the shard travels. No communication.
    """
    if tuple(full.shape) != tuple(param.shape):
        raise ValueError(f"a value of shape {tuple(full.shape)} for a {tuple(param.shape)} tensor")
    local = _local(param)
    shard = full
    for dim, index in enumerate(local_indices(param)):
        if len(index) == full.shape[dim]:
            continue
        if len(index) and int(index[-1] - index[0]) == len(index) - 1:
            shard = shard.narrow(dim, int(index[0]), len(index))
        else:
            shard = shard.index_select(dim, index.to(full.device))
    local.copy_(shard.to(device=local.device, dtype=local.dtype))


def init_std(cfg: ModelConfig, name: str) -> float | None:
    """The normal std a block-style parameter ``name`` is drawn with; None for a norm gain.

    init_std for the embedding and every projection, init_std / sqrt(2 * n_layers) for the
    projections that write the residual stream, ones for norm gains, 0 (zeros) for
    biases and attention sinks (a sink of 0 starts as one more key of logit 0). Shared by
    the decoder and by any block built like its blocks (gated cross-attention).
    """
    if name.endswith("norm.weight"):
        return None
    if name.endswith((".bias", "attention.sinks", "experts.b1", "experts.b3", "experts.b2")):
        return 0.0
    if name.endswith(("attention.wo.weight", "w2.weight", "experts.w2")):
        # The projections that write the residual stream (dense, shared and routed
        # experts' down projections): its variance at init must not grow with depth.
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std
