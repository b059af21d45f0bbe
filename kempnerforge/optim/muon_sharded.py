"""Newton-Schulz on sharded matrices: each whole matrix orthogonalised once per step, by one
rank of the ranks that share it, and every rank handed back its own shard of the result.

Muon's update is a function of the whole matrix (its singular vectors), so a rank that
holds a row or column shard cannot compute its part alone. Gathering every matrix on every
rank would run each Newton-Schulz as many times as there are ranks; instead the matrices
of a step are dealt round-robin to owner ranks, in the order the optimizer lists them
(the same on every rank of a mesh: FSDP and tensor parallelism shard the same model), so
each rank orthogonalises about 1/n of them. Two all-to-all exchanges per step carry the
traffic: shards to their owners, then each owner's result back in shards.

Supported layouts: a DTensor whose placements are Shard(d) on one mesh dimension and
Replicate on the others (FSDP, HSDP, tensor parallelism on its own), or Replicate only.
Each replica along a Replicate dimension runs its own owners over its shard group: the
replicas hold the same update, so they compute the same results without talking to each
other, and no replica waits for another. A matrix sharded on several mesh dimensions (FSDP
with tensor parallelism) or held as a Partial sum is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

Orthogonalize = Callable[[torch.Tensor], torch.Tensor]


def orthogonalize_sharded(updates: list[DTensor], orthogonalize: Orthogonalize) -> list[DTensor]:
    """``orthogonalize`` applied to each update's full matrix, returned sharded like it.

    Every rank of the updates' mesh calls this with the same matrices in the same order.
    Matrices sharded over the same mesh dimension (and of one dtype) share one exchange;
    matrices replicated on every mesh dimension are orthogonalised where they are, as one
    process would.
    """
    results: list[DTensor | None] = [None] * len(updates)
    exchanges: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, u in enumerate(updates):
        mesh_dim = _shard_mesh_dim(u)
        if mesh_dim is None:
            local = orthogonalize(u.to_local())
            results[i] = _as_dtensor(local, u)
        else:
            exchanges.setdefault((mesh_dim, u.dtype), []).append(i)
    # Insertion order: the same on every rank, since the updates' order is.
    for (mesh_dim, _), indices in exchanges.items():
        chosen = [updates[i] for i in indices]
        for i, out in zip(indices, _exchange(chosen, mesh_dim, orthogonalize), strict=True):
            results[i] = out
    return [r for r in results if r is not None]  # every index was filled above


def owner_of(index: int, group_size: int) -> int:
    """The group rank that orthogonalises the index-th matrix of an exchange: round-robin,
    so each rank takes at most ceil(matrices / ranks) of them."""
    return index % group_size


def shard_sizes(size: int, parts: int) -> list[int]:
    """How DTensor's Shard splits ``size`` rows over ``parts`` ranks: torch.chunk's pieces
    of ceil(size / parts), the last ones shorter or empty when it does not divide."""
    chunk = -(-size // parts)
    return [max(0, min(chunk, size - r * chunk)) for r in range(parts)]


def _shard_mesh_dim(u: DTensor) -> int | None:
    """The mesh dimension u is sharded over, or None when it is replicated on all of them."""
    sharded = [d for d, p in enumerate(u.placements) if not isinstance(p, Replicate)]
    if not sharded:
        return None
    placement = u.placements[sharded[0]]
    if len(sharded) > 1 or type(placement) is not Shard:
        raise NotImplementedError(
            f"Muon orthogonalises matrices sharded on one mesh dimension (Shard(d) there, "
            f"Replicate elsewhere); got placements {u.placements}"
        )
    return sharded[0]


def _exchange(updates: list[DTensor], mesh_dim: int, orthogonalize: Orthogonalize) -> list[DTensor]:
    """Orthogonalise updates sharded over one mesh dimension: shards to owners, whole
    matrices orthogonalised there, results back in shards. Two all-to-alls in all.

    The host work per rank is about the matrices plus the group's size: one pass over the
    matrices for what this rank sends and gets back, and each owned matrix's shapes on
    every rank (owned matrices are about 1/n of them)."""
    mesh = updates[0].device_mesh
    group = mesh.get_group(mesh_dim)
    n = mesh.size(mesh_dim)
    me = mesh.get_local_rank(mesh_dim)
    dims = [_shard_dim(u, mesh_dim) for u in updates]
    device, dtype = updates[0].to_local().device, updates[0].dtype

    # Shards to owners: to rank r, my shards of r's matrices, in index order; and from
    # each owner, later, my shard of each of its results.
    sends: list[list[torch.Tensor]] = [[] for _ in range(n)]
    back_from = [0] * n
    owned = []
    for i, u in enumerate(updates):
        owner = owner_of(i, n)
        sends[owner].append(u.to_local().reshape(-1))
        back_from[owner] += u.to_local().numel()
        if owner == me:
            owned.append(i)
    shapes = {i: [_local_shape(updates[i], dims[i], n, r) for r in range(n)] for i in owned}
    from_each = [sum(_numel(shapes[i][r]) for i in owned) for r in range(n)]
    received = _all_to_all(sends, from_each, group, device, dtype)

    # Whole matrices from the pieces, in rank order along the sharded dimension.
    pieces: dict[int, list[torch.Tensor]] = {i: [] for i in owned}
    for r, block in enumerate(received):
        offset = 0
        for i in owned:
            count = _numel(shapes[i][r])
            pieces[i].append(block[offset : offset + count].view(shapes[i][r]))
            offset += count
    results = {i: orthogonalize(torch.cat(pieces[i], dim=dims[i])) for i in owned}

    # Results back: to rank r, r's shard of each matrix I own; from each owner, my shards.
    backs = [[_shard_of(results[i], dims[i], n, r) for i in owned] for r in range(n)]
    returned = _all_to_all(backs, back_from, group, device, dtype)
    out: list[DTensor] = []
    offsets = [0] * n
    for i, u in enumerate(updates):
        r = owner_of(i, n)
        mine = u.to_local()
        local = returned[r][offsets[r] : offsets[r] + mine.numel()].view(mine.shape)
        offsets[r] += mine.numel()
        out.append(_as_dtensor(local, u))
    return out


def _all_to_all(
    sends: list[list[torch.Tensor]],
    receive_counts: list[int],
    group: dist.ProcessGroup,
    device: torch.device,
    dtype: torch.dtype,
) -> list[torch.Tensor]:
    """One all_to_all_single: sends[r] (flat tensors) to group rank r; the flat blocks
    received from each rank, receive_counts[r] elements from rank r."""
    flat = [torch.cat(s) if s else torch.empty(0, device=device, dtype=dtype) for s in sends]
    send_counts = [t.numel() for t in flat]
    output = torch.empty(sum(receive_counts), device=device, dtype=dtype)
    dist.all_to_all_single(
        output,
        torch.cat(flat),
        output_split_sizes=receive_counts,
        input_split_sizes=send_counts,
        group=group,
    )
    return list(output.split(receive_counts))


def _shard_dim(u: DTensor, mesh_dim: int) -> int:
    placement = u.placements[mesh_dim]
    assert isinstance(placement, Shard)
    return placement.dim


def _local_shape(u: DTensor, dim: int, parts: int, rank: int) -> torch.Size:
    """The shape of rank ``rank``'s shard of u along ``dim``."""
    shape = list(u.shape)
    shape[dim] = shard_sizes(shape[dim], parts)[rank]
    return torch.Size(shape)


def _shard_of(full: torch.Tensor, dim: int, parts: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` along ``dim``, flat, as DTensor's Shard cuts it."""
    sizes = shard_sizes(full.size(dim), parts)
    start = sum(sizes[:rank])
    return full.narrow(dim, start, sizes[rank]).reshape(-1)


def _numel(shape: torch.Size) -> int:
    return shape.numel()


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
