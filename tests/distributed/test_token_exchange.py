"""dispatch_tokens / combine_tokens on two real gloo ranks: the experts see the right rows in
the documented order, and outputs and gradients match running every expert in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from kempnerforge.model.moe.token_exchange import combine_tokens, dispatch_tokens
from tests.support.dist import run_distributed

DIM, OUT_DIM = 5, 3
SCENARIOS: dict[str, list[list[int]]] = {
    # Rank 0 sends no rows to rank 1; expert 2 gets no rows from anyone.
    "four_experts_one_way": [[3, 0, 0, 0], [2, 1, 0, 4]],
    # Rank 0 holds no tokens at all but still runs expert 0 for rank 1.
    "two_experts_empty_rank": [[0, 0], [3, 2]],
    "four_experts_random": [[5, 0, 2, 1], [0, 4, 3, 0]],
    "two_experts_random": [[4, 1], [2, 6]],
}


def _rows(counts: list[int], rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.randn(sum(counts), DIM, generator=gen)


def _upstream(counts: list[int], rank: int) -> torch.Tensor:
    """A fixed gradient for the combined outputs, so every row's gradient is distinct."""
    gen = torch.Generator().manual_seed(200 + rank)
    return torch.randn(sum(counts), OUT_DIM, generator=gen)


def _apply_experts(
    rows: torch.Tensor, counts: list[int], weights: torch.Tensor, first_expert: int
) -> torch.Tensor:
    """Rows of expert first_expert + i times weights[first_expert + i], block by block."""
    blocks = rows.split(counts)
    return torch.cat([b @ weights[first_expert + i] for i, b in enumerate(blocks)])


def _max_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    return (actual - expected).abs().max().item() if actual.numel() else 0.0


def _world() -> dist.ProcessGroup:
    world = dist.group.WORLD
    assert isinstance(world, dist.ProcessGroup)
    return world


def _round_trip(rank: int, world_size: int, all_counts: list[list[int]]) -> dict[str, Any]:
    """Experts on the owning rank against the same experts run on all rows in one process."""
    num_experts = len(all_counts[0])
    num_local = num_experts // world_size
    all_rows = [_rows(c, r) for r, c in enumerate(all_counts)]
    ups = [_upstream(c, r) for r, c in enumerate(all_counts)]
    weights = torch.randn(num_experts, DIM, OUT_DIM, generator=torch.Generator().manual_seed(7))

    x = all_rows[rank].clone().requires_grad_()
    w = weights.clone().requires_grad_()
    counts = torch.tensor(all_counts[rank], dtype=torch.int64)
    local_rows, local_counts, plan = dispatch_tokens(x, counts, _world())
    out = _apply_experts(local_rows, local_counts.tolist(), w, rank * num_local)
    combined = combine_tokens(out, plan)
    (combined * ups[rank]).sum().backward()
    assert w.grad is not None and x.grad is not None
    w_grad = w.grad.clone()
    dist.all_reduce(w_grad)

    ref_rows = [r.clone().requires_grad_() for r in all_rows]
    ref_w = weights.clone().requires_grad_()
    ref_out = [_apply_experts(r, c, ref_w, 0) for r, c in zip(ref_rows, all_counts, strict=True)]
    torch.stack([(o * u).sum() for o, u in zip(ref_out, ups, strict=True)]).sum().backward()
    ref_rows_grad = ref_rows[rank].grad
    assert ref_w.grad is not None and ref_rows_grad is not None

    # Local expert j's rows: from source rank 0, then rank 1, each in that rank's order.
    per_source = [r.split(c) for r, c in zip(all_rows, all_counts, strict=True)]
    expert_ids = range(rank * num_local, (rank + 1) * num_local)
    expected_local = torch.cat([blocks[g] for g in expert_ids for blocks in per_source])
    return {
        "local_counts": local_counts.tolist(),
        "expected_local_counts": [sum(c[g] for c in all_counts) for g in expert_ids],
        "local_rows": _max_diff(local_rows, expected_local),
        "output": _max_diff(combined, ref_out[rank]),
        "rows_grad": _max_diff(x.grad, ref_rows_grad),
        "weights_grad": _max_diff(w_grad, ref_w.grad),
    }


def _one_rank_group(rank: int, world_size: int) -> dict[str, bool]:
    """A group of size 1 exchanges nothing and hands back the very same tensors."""
    groups = [dist.new_group([r]) for r in range(world_size)]  # every rank creates every group
    rows, counts = torch.randn(4, DIM), torch.tensor([1, 3])
    mine = groups[rank]
    assert isinstance(mine, dist.ProcessGroup) and mine.size() == 1
    local_rows, local_counts, plan = dispatch_tokens(rows, counts, mine)
    out = torch.randn(4, OUT_DIM)
    return {
        "rows": local_rows is rows,
        "counts": local_counts is counts,
        "outputs": combine_tokens(out, plan) is out,
    }


def _error(fn, *args) -> str:
    try:
        fn(*args)
    except ValueError as e:
        return str(e)
    return "no error"


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    """Every case on one spawned group: the process start-up dominates the cost."""
    results: dict[str, Any] = {
        name: _round_trip(rank, world_size, counts) for name, counts in SCENARIOS.items()
    }
    results["one_rank_group"] = _one_rank_group(rank, world_size)
    world = _world()
    three = torch.tensor([1, 1, 1])
    results["three_experts"] = _error(dispatch_tokens, torch.randn(3, DIM), three, world)
    results["short_rows"] = _error(dispatch_tokens, torch.randn(1, DIM), three.new_ones(2), world)
    return results


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_scenarios, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_experts_receive_their_rows_expert_major_then_by_source_rank(ranks, scenario):
    for rank in ranks:
        assert rank[scenario]["local_counts"] == rank[scenario]["expected_local_counts"]
        assert rank[scenario]["local_rows"] == 0.0


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_round_trip_matches_running_every_expert_in_one_process(ranks, scenario):
    for rank in ranks:
        assert rank[scenario]["output"] <= 1e-6
        assert rank[scenario]["rows_grad"] <= 1e-6
        # The ranks' partial sums meet in all_reduce: another summation order, a few ulp.
        assert rank[scenario]["weights_grad"] <= 1e-5


@pytest.mark.distributed
def test_a_group_of_one_rank_exchanges_nothing(ranks):
    expected = {"rows": True, "counts": True, "outputs": True}
    assert [rank["one_rank_group"] for rank in ranks] == [expected, expected]


@pytest.mark.distributed
def test_experts_that_do_not_split_over_the_ranks_are_rejected(ranks):
    message = "3 experts do not split evenly over 2 expert-parallel ranks"
    assert [rank["three_experts"] for rank in ranks] == [message, message]


@pytest.mark.distributed
def test_counts_beyond_the_rows_are_rejected(ranks):
    message = "counts sum to 2 rows but rows has 1"
    assert [rank["short_rows"] for rank in ranks] == [message, message]


def test_without_a_group_rows_and_counts_pass_through_unchanged():
    rows, counts, out = torch.randn(5, DIM), torch.tensor([2, 0, 3]), torch.randn(5, OUT_DIM)
    local_rows, local_counts, plan = dispatch_tokens(rows, counts, None)
    assert local_rows is rows and local_counts is counts
    assert combine_tokens(out, plan) is out
