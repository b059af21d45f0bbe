"""run_distributed itself: what every rank starts with, whatever ran before in the server."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed


def _what_the_rank_sees(rank: int, world_size: int) -> dict:
    return {
        "marker": os.environ.get("KF_TEST_MARKER"),
        "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
        "threads": torch.get_num_threads(),
        "group": (dist.get_rank(), dist.get_world_size()),
        "pid": os.getpid(),
    }


def test_every_rank_sees_the_callers_environment_of_this_call(monkeypatch):
    monkeypatch.setenv("KF_TEST_MARKER", "first")
    first = run_distributed(_what_the_rank_sees, 2)
    # Changed after the fork server started: the ranks still see the caller's value.
    monkeypatch.setenv("KF_TEST_MARKER", "second")
    second = run_distributed(_what_the_rank_sees, 2)
    assert [r["marker"] for r in first] == ["first", "first"]
    assert [r["marker"] for r in second] == ["second", "second"]
    for rank, record in enumerate(second):
        assert record["rank_env"] == (str(rank), "2")
        assert record["group"] == (rank, 2) and record["threads"] == 1
    # Four processes, none reused.
    assert len({r["pid"] for r in first + second} | {os.getpid()}) == 5


def _crash_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        import ctypes

        ctypes.string_at(0)  # a read of address 0: SIGSEGV in native code
    dist.barrier()


def test_a_rank_that_crashes_in_native_code_fails_with_its_stacks():
    with pytest.raises(RuntimeError) as raised:
        run_distributed(_crash_on_rank_one, 2, timeout_s=60)
    message = str(raised.value)
    assert "SIGSEGV" in message and "Segmentation fault" in message
    assert "_crash_on_rank_one" in message  # the Python frame that was running
