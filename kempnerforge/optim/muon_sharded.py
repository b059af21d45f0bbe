"""Newton-Schulz on sharded matrices: each whole matrix orthogonalised once per step, by one
rank of the ranks that share it, and every rank handed back its own shard of the result.

Muon's update is a function of the whole matrix (its singular vectors), so a rank that
holds a row or column shard cannot compute its part alone. Gathering every matrix on every
rank would run each Newton-Schulz as many times as there are ranks; instead the matrices
of a step are dealt to owner ranks (deal_owners: the same deal on every rank of a mesh,
from the same shapes in the same order, since FSDP and tensor parallelism shard the same
model), so each rank orthogonalises about 1/n of them and about 1/n of the work. Two
all-to-all exchanges per step carry the traffic: shards to their owners, then each
owner's result back in shards.

The ranks that share a matrix are those of the mesh dimensions it is sharded over: one
dimension under FSDP, HSDP or tensor parallelism alone, two under FSDP with tensor
parallelism (``dp_shard`` x ``tp``, whose group is the mesh's flattened dimension of the
two, created once when the optimizer is built). Shard(d) and FSDP's _StridedShard(d) (the
rows a rank holds after tensor parallelism cut them first) are both read from the
placements, so the owner puts each piece where it belongs. Each replica along a Replicate
dimension runs its own owners over its shard group: the replicas hold the same update, so
they compute the same results without talking to each other, and no replica waits for
another. A Partial sum is refused.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]

Runs = list[tuple[int, int]]
"""The indices a shard holds along one tensor dimension, in the order it holds them, as
(start, length) runs of consecutive indices: one run for Shard, one per split for
_StridedShard."""


def orthogonalize_sharded(updates: list[DTensor], orthogonalize: Orthogonalize) -> list[DTensor]:
    """``orthogonalize`` applied to each update's full matrix, returned sharded like it.

    Every rank of the updates' mesh calls this with the same matrices in the same order.
    Matrices sharded over the same mesh dimensions (and of one dtype) share one exchange;
    matrices replicated on every mesh dimension are orthogonalised where they are, as one
    process would.
    """
    results: list[DTensor | None] = [None] * len(updates)
    exchanges: dict[tuple[DeviceMesh, tuple[int, ...], torch.dtype], list[int]] = {}
    for i, u in enumerate(updates):
        mesh_dims = sharded_mesh_dims(u)
        if not mesh_dims or _cuts_only_the_stack(u, mesh_dims):
            results[i] = _as_dtensor(orthogonalize(u.to_local()), u)
        else:
            exchanges.setdefault((u.device_mesh, mesh_dims, u.dtype), []).append(i)
    # Insertion order: the same on every rank, since the updates' order is.
    for (_, mesh_dims, _), indices in exchanges.items():
        chosen = [updates[i] for i in indices]
        for i, out in zip(indices, _exchange(chosen, mesh_dims, orthogonalize), strict=True):
            results[i] = out
    return [r for r in results if r is not None]  # every index was filled above


def prepare_exchanges(params: Iterable[torch.Tensor]) -> None:
    """Create the process groups the exchanges of these parameters will use, now.

    A matrix sharded on two mesh dimensions is exchanged over their flattened group, which
    every rank of the job creates together; doing it when the optimizer is built (on every
    rank, from the same model) keeps that collective out of the first step, where pipeline
    stages reach their matrices at different times."""
    for p in params:
        if isinstance(p, DTensor):
            mesh_dims = sharded_mesh_dims(p)
            if len(mesh_dims) > 1:
                exchange_group(p.device_mesh, mesh_dims)


def _cuts_only_the_stack(u: DTensor, mesh_dims: tuple[int, ...]) -> bool:
    """Whether u is a stack of matrices (experts) split only between matrices, never
    through one: each rank then holds whole matrices (expert parallelism, FSDP over the
    expert dimension) and orthogonalises its own, as one process would."""
    return all(u.placements[d].dim < u.ndim - 2 for d in mesh_dims)  # type: ignore[union-attr]


def deal_owners(shapes: Sequence[Sequence[int]], group_size: int) -> list[int]:
    """The group rank that orthogonalises each matrix of an exchange.

    The matrices are dealt in laps, largest Newton-Schulz cost first, each lap in the
    opposite direction to the last (0..n-1, then n-1..0): each rank takes at most
    ceil(matrices / ranks) of them, and the big ones spread instead of piling onto the
    first ranks. Every rank computes the same deal from the same shapes."""
    order = sorted(range(len(shapes)), key=lambda i: -newton_schulz_cost(shapes[i]))
    owners = [0] * len(shapes)
    for position, i in enumerate(order):
        lap, seat = divmod(position, group_size)
        owners[i] = seat if lap % 2 == 0 else group_size - 1 - seat
    return owners


def newton_schulz_cost(shape: Sequence[int]) -> int:
    """Multiply-adds of one Newton-Schulz iteration on a matrix (or a stack of them) of
    this shape, up to a constant: the Gram matrix of the short side (small^2 x large), its
    square (small^3) and the product back (small^2 x large), per matrix of the stack."""
    small, large = sorted(shape[-2:])
    return math.prod(shape[:-2]) * small * small * (2 * large + small)


def sharded_mesh_dims(u: DTensor) -> tuple[int, ...]:
    """The mesh dimensions u is split over (Shard or _StridedShard on a dimension of more
    than one rank); empty when u is whole on every rank."""
    dims = []
    for d, placement in enumerate(u.placements):
        if isinstance(placement, Replicate) or u.device_mesh.size(d) == 1:
            continue
        if not isinstance(placement, (Shard, _StridedShard)):
            raise NotImplementedError(
                f"Muon orthogonalises matrices sharded or replicated on each mesh "
                f"dimension; got placements {u.placements}"
            )
        dims.append(d)
    return tuple(dims)


def exchange_group(mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> tuple[dist.ProcessGroup, int]:
    """The process group of the ranks that share a matrix sharded over ``mesh_dims``, and
    this rank's place in it: that dimension's own group, or the dimensions' flattened mesh
    (torch keeps one per set of dimensions, so asking again returns the same one), whose
    local ranks run row-major over the dimensions' coordinates, the order _exchange reads
    coordinates in."""
    if len(mesh_dims) == 1:
        return mesh.get_group(mesh_dims[0]), mesh.get_local_rank(mesh_dims[0])
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"Muon exchanges a matrix sharded on mesh dimensions {mesh_dims} over their "
            f"flattened group, which needs a mesh with named dimensions"
        )
    flat = mesh[tuple(names[d] for d in mesh_dims)]._flatten()
    return flat.get_group(), flat.get_local_rank()


def shard_runs(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_sizes: Sequence[int],
    coordinate: Sequence[int],
) -> list[Runs]:
    """Which indices of each tensor dimension the rank at ``coordinate`` holds.

    Placements apply left to right, each cutting what the ones before it left: Shard(d)
    cuts into ``mesh_size`` torch.chunk pieces (ceil-sized, the last shorter or empty) and
    keeps the coordinate's piece; _StridedShard(d, split_factor=k) first cuts into k pieces
    the same way (the shards of the placements to its right, applied before it) and keeps
    the coordinate's piece of each, in order."""
    runs: list[Runs] = [[(0, size)] for size in shape]
    for d, placement in enumerate(placements):
        if isinstance(placement, Replicate) or mesh_sizes[d] == 1:
            continue
        dim, parts, index = placement.dim, mesh_sizes[d], coordinate[d]  # type: ignore[union-attr]
        if isinstance(placement, _StridedShard):
            splits = int(placement.split_factor)
            runs[dim] = [
                run
                for k in range(splits)
                for run in _chunk(_chunk(runs[dim], splits, k), parts, index)
            ]
        else:
            runs[dim] = _chunk(runs[dim], parts, index)
    return runs


def _chunk(runs: Runs, parts: int, index: int) -> Runs:
    """Piece ``index`` of ``parts`` torch.chunk pieces of the indices ``runs`` list."""
    total = sum(length for _, length in runs)
    size = -(-total // parts)
    start = min(index * size, total)
    return _take(runs, start, min(size, total - start))


def _take(runs: Runs, start: int, count: int) -> Runs:
    """The ``count`` indices from position ``start`` of the indices ``runs`` list."""
    taken: Runs = []
    position = 0
    for begin, length in runs:
        lo, hi = max(start, position), min(start + count, position + length)
        if lo < hi:
            taken.append((begin + lo - position, hi - lo))
        position += length
    return taken


def _exchange(
    updates: list[DTensor], mesh_dims: tuple[int, ...], orthogonalize: Orthogonalize
) -> list[DTensor]:
    """Orthogonalise updates sharded over the same mesh dimensions: shards to owners,
    whole matrices orthogonalised there, results back in shards. Two all-to-alls in all.

    The host work per rank is about the matrices plus the group's size: one pass over the
    matrices for what this rank sends and gets back, and each owned matrix's shard layout
    on every rank (owned matrices are about 1/n of them)."""
    mesh = updates[0].device_mesh
    group, me = exchange_group(mesh, mesh_dims)
    n = math.prod(mesh.size(d) for d in mesh_dims)
    coordinates = _group_coordinates(mesh, mesh_dims)
    device, dtype = updates[0].to_local().device, updates[0].dtype

    # Shards to owners: to rank r, my shards of r's matrices, in index order; and from
    # each owner, later, my shard of each of its results.
    owners = deal_owners([u.shape for u in updates], n)
    sends: list[list[torch.Tensor]] = [[] for _ in range(n)]
    back_from = [0] * n
    owned = []
    for i, u in enumerate(updates):
        owner = owners[i]
        sends[owner].append(u.to_local())
        back_from[owner] += u.to_local().numel()
        if owner == me:
            owned.append(i)
    layouts = {
        i: [
            shard_runs(updates[i].shape, updates[i].placements, mesh.shape, coordinates[r])
            for r in range(n)
        ]
        for i in owned
    }
    for i in owned:  # the placements read as torch lays them out, checked on this rank
        if _shape(layouts[i][me]) != updates[i].to_local().shape:
            raise RuntimeError(
                f"Muon read the shard of a {tuple(updates[i].shape)} matrix with placements "
                f"{updates[i].placements} as {tuple(_shape(layouts[i][me]))}, but this rank "
                f"holds {tuple(updates[i].to_local().shape)}"
            )
    from_each = [sum(_numel(layouts[i][r]) for i in owned) for r in range(n)]
    received = _all_to_all(sends, from_each, group, device, dtype)

    # Whole matrices from the pieces, each put where its rank's runs say.
    results = {}
    offsets = [0] * n
    for i in owned:
        full = torch.empty(updates[i].shape, device=device, dtype=dtype)
        for r, block in enumerate(received):
            count = _numel(layouts[i][r])
            piece = block[offsets[r] : offsets[r] + count].view(_shape(layouts[i][r]))
            offsets[r] += count
            _place(full, piece, layouts[i][r])
        results[i] = orthogonalize(full)

    # Results back: to rank r, r's shard of each matrix I own; from each owner, my shards.
    backs = [[_cut(results[i], layouts[i][r]) for i in owned] for r in range(n)]
    returned = _all_to_all(backs, back_from, group, device, dtype)
    out: list[DTensor] = []
    offsets = [0] * n
    for i, u in enumerate(updates):
        r = owners[i]
        mine = u.to_local()
        local = returned[r][offsets[r] : offsets[r] + mine.numel()].view(mine.shape)
        offsets[r] += mine.numel()
        out.append(_as_dtensor(local, u))
    return out


def _group_coordinates(mesh: DeviceMesh, mesh_dims: tuple[int, ...]) -> list[list[int]]:
    """Each exchange-group rank's coordinate on ``mesh``: row-major over ``mesh_dims``
    (exchange_group's order); this rank's own on the other dimensions, which shard_runs
    does not read (they replicate)."""
    mine = mesh.get_coordinate()
    assert mine is not None, "this rank is not on the matrix's mesh"
    sizes = [mesh.size(d) for d in mesh_dims]
    coordinates = []
    for along in itertools.product(*(range(s) for s in sizes)):
        coordinate = list(mine)
        for d, c in zip(mesh_dims, along, strict=True):
            coordinate[d] = c
        coordinates.append(coordinate)
    return coordinates


def _blocks(runs: list[Runs]) -> Iterable[tuple[tuple[slice, ...], tuple[slice, ...]]]:
    """For each block of consecutive indices a shard holds: where it sits in the whole
    tensor, and where in the shard."""
    per_dim = []
    for dim_runs in runs:
        pairs, local = [], 0
        for start, length in dim_runs:
            pairs.append((slice(start, start + length), slice(local, local + length)))
            local += length
        per_dim.append(pairs)
    for combo in itertools.product(*per_dim):
        yield tuple(g for g, _ in combo), tuple(s for _, s in combo)


def _place(full: torch.Tensor, piece: torch.Tensor, runs: list[Runs]) -> None:
    for whole_at, shard_at in _blocks(runs):
        full[whole_at] = piece[shard_at]


def _cut(full: torch.Tensor, runs: list[Runs]) -> torch.Tensor:
    """The shard ``runs`` describe, cut from ``full``: a view when it is one block (the
    send buffer copies it once)."""
    if all(len(r) == 1 for r in runs):
        return full[next(iter(_blocks(runs)))[0]]
    piece = full.new_empty(_shape(runs))
    for whole_at, shard_at in _blocks(runs):
        piece[shard_at] = full[whole_at]
    return piece


def _shape(runs: list[Runs]) -> torch.Size:
    return torch.Size(sum(length for _, length in dim_runs) for dim_runs in runs)


def _numel(runs: list[Runs]) -> int:
    return math.prod(_shape(runs))


def _all_to_all(
    sends: list[list[torch.Tensor]],
    receive_counts: list[int],
    group: dist.ProcessGroup,
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One all_to_all_single: the tensors of sends[r] to group rank r, packed into one
    send buffer with one copy each (a strided view copied as it is read); the flat blocks
    received from each rank, receive_counts[r] elements from rank r."""
    send_counts = [sum(t.numel() for t in tensors) for tensors in sends]
    packed = torch.empty(sum(send_counts), device=device, dtype=dtype)
    offset = 0
    for tensors in sends:
        for t in tensors:
            packed[offset : offset + t.numel()].view(t.shape).copy_(t)
            offset += t.numel()
    output = torch.empty(sum(receive_counts), device=device, dtype=dtype)
    dist.all_to_all_single(
        output,
        packed,
        output_split_sizes=receive_counts,
        input_split_sizes=send_counts,
        group=group,
    )
    return list(output.split(receive_counts))


def _as_dtensor(local: torch.Tensor, like: DTensor) -> DTensor:
    """``local`` as this rank's shard of a DTensor laid out like ``like``."""
    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )
