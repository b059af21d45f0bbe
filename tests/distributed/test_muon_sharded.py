"""Muon on sharded DTensor matrices (FSDP's Shard(0), tensor parallelism's Shard(0) and
Shard(1), uneven splits included) steps every rank's shard to what one process's Muon
gives on the whole matrices, and orthogonalises each matrix once per step, on one rank."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from kempnerforge.optim import muon
from kempnerforge.optim.muon import Muon
from tests.support.dist import run_distributed
from tests.support.tolerance import muon_atol

pytestmark = pytest.mark.distributed

# Square, wide, tall, odd sizes: 5, 7, 3, 11 and 9 split unevenly over two ranks, and the
# one-row matrix leaves rank 1 an empty row shard.
SHAPES = [(6, 5), (5, 7), (3, 3), (11, 2), (2, 9), (1, 4)]
STEPS = 3
LR, MOMENTUM, WEIGHT_DECAY = 0.02, 0.9, 0.1
LAYOUTS: dict[str, list[list[Placement]]] = {
    "shard_rows": [[Shard(0)]] * len(SHAPES),  # FSDP, and column-wise tensor parallelism
    "shard_columns": [[Shard(1)]] * len(SHAPES),  # row-wise tensor parallelism
    "mixed": [[Shard(i % 2)] for i in range(len(SHAPES))],  # both, in one bucket
    "replicated": [[Replicate()]] * len(SHAPES),  # every rank holds the whole matrix
}
FOREACH = (True, False, None)


def _draws() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(*s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(*s, generator=gen) for s in SHAPES] for _ in range(STEPS)]
    return weights, grads


def _one_process() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Muon's per-matrix loop on the whole matrices: the weights and momentum buffers."""
    weights, grads = _draws()
    params = [torch.nn.Parameter(w) for w in weights]
    opt = Muon(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, foreach=False)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g
        opt.step()
    return [p.detach() for p in params], [opt.state[p]["momentum_buffer"] for p in params]


def _sharded(layout: str, foreach: bool | None, mesh) -> tuple[list, list, int]:
    """The same steps on DTensors laid out by ``layout``: full weights and buffers, and how
    many Newton-Schulz calls ran on this rank."""
    weights, grads = _draws()
    placements = LAYOUTS[layout]
    params = [
        torch.nn.Parameter(distribute_tensor(w, mesh, pl))
        for w, pl in zip(weights, placements, strict=True)
    ]
    opt = Muon(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY, foreach=foreach)
    calls = 0
    plain = muon.newton_schulz_orthogonalize

    def counted(matrix: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
        nonlocal calls
        assert not isinstance(matrix, DTensor), "Newton-Schulz runs on whole plain matrices"
        calls += 1
        return plain(matrix, steps, eps)

    muon.newton_schulz_orthogonalize = counted
    try:
        for step_grads in grads:
            for p, g, pl in zip(params, step_grads, placements, strict=True):
                p.grad = distribute_tensor(g, mesh, pl)
            opt.step()
    finally:
        muon.newton_schulz_orthogonalize = plain
    full_params = [_full(p) for p in params]
    full_bufs = [_full(opt.state[p]["momentum_buffer"]) for p in params]
    return full_params, full_bufs, calls


def _full(t: torch.Tensor) -> torch.Tensor:
    assert isinstance(t, DTensor), "the parameters and their state stay DTensors"
    return t.full_tensor()


def _by_shards(layout: str, world_size: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What the ranks compute, run by one process: the elementwise operations (the same
    foreach calls, in the same order) on contiguous copies of exactly the shards DTensor
    gives each rank (one copy of a replicated matrix), each whole update put back together
    for Newton-Schulz, and each rank's shard of the result applied to its shard of the
    weight. The weights and buffers whole.

    The same float operations on the same values as the ranks, so equal to their result
    bit for bit on any machine; a shard sent to the wrong owner or cut the wrong way, or a
    matrix left out, is not."""
    weights, grads = _draws()
    placements = LAYOUTS[layout]
    dims = [pl[0].dim if isinstance(pl[0], Shard) else None for pl in placements]
    parts = [world_size if d is not None else 1 for d in dims]

    def cut(t: torch.Tensor, dim: int | None, n: int) -> list[torch.Tensor]:
        if dim is None:
            return [t.clone()]
        pieces, _ = Shard(dim)._split_tensor(t, n, with_padding=False)
        return [piece.contiguous().clone() for piece in pieces]

    params = [cut(w, d, n) for w, d, n in zip(weights, dims, parts, strict=True)]
    bufs = [[torch.zeros_like(s) for s in shards] for shards in params]
    for step_grads in grads:
        shard_grads = [cut(g, d, n) for g, d, n in zip(step_grads, dims, parts, strict=True)]
        for bs, gs in zip(bufs, shard_grads, strict=True):
            torch._foreach_mul_(bs, MOMENTUM)
            torch._foreach_add_(bs, gs)
        updates = [
            [g.add(b, alpha=MOMENTUM) for g, b in zip(gs_, bs_, strict=True)]
            for gs_, bs_ in zip(shard_grads, bufs, strict=True)
        ]
        for i, (shards, d) in enumerate(zip(updates, dims, strict=True)):
            whole = shards[0] if d is None else torch.cat(shards, dim=d)
            ortho = muon.newton_schulz_orthogonalize(whole, muon_steps())
            scale = math.sqrt(max(1.0, whole.size(0) / whole.size(1)))
            ortho_shards = cut(ortho, d, parts[i])
            torch._foreach_mul_(params[i], 1 - LR * WEIGHT_DECAY)
            torch._foreach_add_(params[i], ortho_shards, alpha=-LR * scale)
    whole_params = [
        s[0] if d is None else torch.cat(s, dim=d) for s, d in zip(params, dims, strict=True)
    ]
    whole_bufs = [
        s[0] if d is None else torch.cat(s, dim=d) for s, d in zip(bufs, dims, strict=True)
    ]
    return whole_params, whole_bufs


def muon_steps() -> int:
    """Muon's default Newton-Schulz steps, which the optimizers here run."""
    return Muon([torch.nn.Parameter(torch.zeros(1, 1))]).defaults["ns_steps"]


def _bounds() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """muon_atol per matrix: how far the shards' elementwise roundings can move the result
    from one process's on the whole matrices, through Newton-Schulz's sensitivity."""
    weights, grads = _draws()
    per_matrix = [
        muon_atol(
            w,
            [step[i] for step in grads],
            lr=LR,
            momentum=MOMENTUM,
            weight_decay=WEIGHT_DECAY,
            ns_steps=muon_steps(),
        )
        for i, w in enumerate(weights)
    ]
    return [b[0] for b in per_matrix], [b[1] for b in per_matrix]


def _against_one_process(rank: int, world_size: int) -> dict[str, Any]:
    """Per layout and foreach choice: the largest difference from the by-shards reference
    (weights, buffers), the worst share of the bound the difference from one process's Muon
    on whole matrices takes (weights, buffers), and this rank's Newton-Schulz calls."""
    mesh = init_device_mesh("cpu", (world_size,))
    want_params, want_bufs = _one_process()
    params_bound, bufs_bound = _bounds()
    out = {}
    for layout in LAYOUTS:
        exact_params, exact_bufs = _by_shards(layout, world_size)
        for foreach in FOREACH:
            got_params, got_bufs, calls = _sharded(layout, foreach, mesh)
            out[f"{layout}/{foreach}"] = {
                "by_shards": (
                    _max_difference(got_params, exact_params),
                    _max_difference(got_bufs, exact_bufs),
                ),
                "share_of_bound": (
                    _share_of_bound(got_params, want_params, params_bound),
                    _share_of_bound(got_bufs, want_bufs, bufs_bound),
                ),
                "calls": calls,
            }
    return out


def _max_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


def _share_of_bound(
    got: list[torch.Tensor], want: list[torch.Tensor], bound: list[torch.Tensor]
) -> float:
    """The largest |got - want| / bound over every element of every matrix: 1 is the bound."""
    return max(
        ((g.double() - w.double()).abs() / b).max().item()
        for g, w, b in zip(got, want, bound, strict=True)
    )


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(_against_one_process, 2)


CASES = [f"{layout}/{foreach}" for layout in LAYOUTS for foreach in FOREACH]


@pytest.mark.parametrize("case", CASES)
def test_sharded_muon_computes_what_its_shards_give_bit_for_bit(results, case):
    """Exact: the reference runs the ranks' own float operations on the ranks' own shards,
    so any difference is the exchange's (a shard to the wrong owner, a transposed or
    misplaced piece, a matrix skipped), not rounding."""
    for rank in results:
        assert rank[case]["by_shards"] == (0.0, 0.0)


@pytest.mark.parametrize("case", CASES)
def test_sharded_muon_steps_like_one_process_within_its_roundings(results, case):
    """Against one process's Muon on the whole matrices: a shard's elementwise kernels may
    round an element otherwise than the whole tensor's (a vectorised fused multiply-add in
    one, a scalar tail in the other), by one rounding per operation; muon_atol carries that
    through Newton-Schulz by its sensitivity at this input. A skipped momentum or a swapped
    shard moves the weights by a share of lr, far past it (see the module's docstring)."""
    for rank in results:
        params_share, bufs_share = rank[case]["share_of_bound"]
        assert params_share <= 1.0, f"weights differ by {params_share:.3g} of the bound"
        assert bufs_share <= 1.0, f"momentum buffers differ by {bufs_share:.3g} of the bound"


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("replicated")])
def test_each_sharded_matrix_is_orthogonalised_once_per_step(results, case):
    calls = [rank[case]["calls"] for rank in results]
    assert sum(calls) == len(SHAPES) * STEPS
    assert max(calls) <= math.ceil(len(SHAPES) / len(results)) * STEPS


@pytest.mark.parametrize("foreach", FOREACH)
def test_replicated_matrices_are_orthogonalised_where_they_are(results, foreach):
    """A matrix every rank holds whole is stepped locally, as data parallelism by
    replication does: every rank runs every Newton-Schulz, and nothing is exchanged."""
    assert [rank[f"replicated/{foreach}"]["calls"] for rank in results] == [len(SHAPES) * STEPS] * 2
