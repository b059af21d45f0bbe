"""agree_on_stop / any_rank on two real gloo ranks: any rank's vote binds all."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.resilience.agreement import agree_on_stop, any_rank
from tests.support.dist import run_distributed

CPU = torch.device("cpu")


def _votes(rank: int, world_size: int) -> dict[str, object]:
    """Every case on one spawned group: the process start-up dominates the cost."""
    only_rank_1 = rank == 1
    return {
        "stop_rank_1": agree_on_stop(only_rank_1, CPU),
        "stop_none": agree_on_stop(False, CPU),
        "any_rank": any_rank([False, only_rank_1, rank == 0], CPU),
    }


@pytest.fixture(scope="module")
def votes() -> list[dict[str, object]]:
    return run_distributed(_votes, 2)


@pytest.mark.distributed
def test_a_stop_wanted_by_rank_1_alone_stops_both_ranks(votes):
    assert [v["stop_rank_1"] for v in votes] == [True, True]


@pytest.mark.distributed
def test_no_rank_wanting_to_stop_means_no_stop(votes):
    assert [v["stop_none"] for v in votes] == [False, False]


@pytest.mark.distributed
def test_any_rank_agrees_on_each_flag_in_one_collective(votes):
    assert [v["any_rank"] for v in votes] == [(False, True, True), (False, True, True)]


def test_without_a_process_group_the_local_decision_stands():
    assert agree_on_stop(True, CPU) is True
    assert agree_on_stop(False, CPU) is False
    assert any_rank([True, False], CPU) == (True, False)
