"""Muon on sharded DTensor matrices (FSDP's Shard(0), tensor parallelism's Shard(0) and
Shard(1), uneven splits included) steps every rank's shard to what one process's Muon
gives on the whole matrices, and orthogonalises each matrix once per step, on one rank."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from kempnerforge.optim import muon
from kempnerforge.optim.muon import Muon
from tests.support.dist import run_distributed

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


def _against_one_process(rank: int, world_size: int) -> dict[str, tuple[float, float, int]]:
    """Per layout and foreach choice: the largest difference from one process in the
    weights and in the momentum buffers, and this rank's Newton-Schulz calls."""
    mesh = init_device_mesh("cpu", (world_size,))
    want_params, want_bufs = _one_process()
    out = {}
    for layout in LAYOUTS:
        for foreach in FOREACH:
            got_params, got_bufs, calls = _sharded(layout, foreach, mesh)
            out[f"{layout}/{foreach}"] = (
                _max_difference(got_params, want_params),
                _max_difference(got_bufs, want_bufs),
                calls,
            )
    return out


def _max_difference(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def results() -> list[dict[str, tuple[float, float, int]]]:
    return run_distributed(_against_one_process, 2)


CASES = [f"{layout}/{foreach}" for layout in LAYOUTS for foreach in FOREACH]


@pytest.mark.parametrize("case", CASES)
def test_sharded_muon_steps_like_one_process_bit_for_bit(results, case):
    """Exact, not close: the momentum and the Nesterov update are elementwise, the same
    float operation on each element as one process runs (the CPU kernels round an element
    the same way wherever a shard boundary puts it), so the owner gathers a matrix equal
    bit for bit to one process's and runs the same Newton-Schulz on it, single-threaded in
    both; the weight update is elementwise again."""
    for rank in results:
        params_diff, bufs_diff, _ = rank[case]
        assert (params_diff, bufs_diff) == (0.0, 0.0)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("replicated")])
def test_each_sharded_matrix_is_orthogonalised_once_per_step(results, case):
    calls = [rank[case][2] for rank in results]
    assert sum(calls) == len(SHAPES) * STEPS
    assert max(calls) <= math.ceil(len(SHAPES) / len(results)) * STEPS


@pytest.mark.parametrize("foreach", FOREACH)
def test_replicated_matrices_are_orthogonalised_where_they_are(results, foreach):
    """A matrix every rank holds whole is stepped locally, as data parallelism by
    replication does: every rank runs every Newton-Schulz, and nothing is exchanged."""
    assert [rank[f"replicated/{foreach}"][2] for rank in results] == [len(SHAPES) * STEPS] * 2
