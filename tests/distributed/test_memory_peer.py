"""Peer copies of the memory tier on real gloo ranks, each standing for a node of its own
(one rank per node, a folder per node for its shared memory): every copy reaches the next
node's rank, a node that lost its folder takes its copy back from the node that kept it,
and the ranks agree on the newest step all of them can reach."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kempnerforge.checkpoint import memory_peer
from kempnerforge.checkpoint.memory_peer import build_peer_link
from kempnerforge.checkpoint.memory_tier import MemoryTier, agreed_step
from tests.support.dist import run_distributed

pytestmark = pytest.mark.distributed


def _state(rank: int, step: int) -> dict:
    """A copy of a rank's share: sizes differ by rank, values by rank and step."""
    return {"weight": torch.arange(1000 + 37 * rank, dtype=torch.float32) * step + rank}


def _ring(rank: int, world_size: int, folder: str) -> dict:
    memory_peer.CHUNK_BYTES = 1000  # each copy (4-5 kB) travels in several messages
    link = build_peer_link(rank, world_size, local_world_size=1)
    assert link is not None
    tier = MemoryTier(Path(folder) / f"node{rank}" / "run", rank, peer=link)
    for step in (2, 4, 6):
        tier.save(step, _state(rank, step))
    tier.wait()
    kept = {
        step: torch.load(tier._file(step, link.source), weights_only=True)["weight"]
        for step in tier.steps(link.source)
    }
    seen = {
        "peer": link.peer,
        "source": link.source,
        "own": tier.steps(),
        "kept": sorted(kept),
        "kept_equal": all(
            torch.equal(v, _state(link.source, s)["weight"]) for s, v in kept.items()
        ),
    }
    world = dist.group.WORLD
    assert world is not None
    # Node 1 is lost: its folder (its copies and the ones it kept for node 0) is gone.
    dist.barrier()
    if rank == 1:
        shutil.rmtree(tier.root)
    dist.barrier()
    seen["agreed"] = step = agreed_step(tier, world)
    assert step is not None
    seen["keeper"] = tier.fetch(step)
    seen["restored_equal"] = torch.equal(tier.load(step)["weight"], _state(rank, step)["weight"])
    # Then node 2 is lost as well: node 1's copies, kept there, are gone with it.
    dist.barrier()
    if rank == 2:
        shutil.rmtree(tier.root)
    if rank == 1:
        tier._file(step).unlink()  # node 1's copy taken back above, gone again
    dist.barrier()
    seen["agreed_after_two"] = agreed_step(tier, world)
    tier.clear()
    seen["left"] = sorted(
        str(p.relative_to(folder)) for p in Path(folder, f"node{rank}").rglob("*.pt")
    )
    return seen


def test_copies_go_round_the_ring_and_a_lost_node_takes_its_copy_back(tmp_path):
    seen = run_distributed(_ring, 3, str(tmp_path))
    assert [(s["peer"], s["source"]) for s in seen] == [(1, 2), (2, 0), (0, 1)]
    for s in seen:
        assert s["own"] == [4, 6] and s["kept"] == [4, 6] and s["kept_equal"]
        assert s["agreed"] == 6 and s["restored_equal"]
    # Node 1 lost its folder: rank 1 took its copy from rank 2, which kept it.
    assert [s["keeper"] for s in seen] == [None, 2, None]
    # With nodes 1 and 2 both lost, rank 1's copy is nowhere: no step is agreed.
    assert [s["agreed_after_two"] for s in seen] == [None, None, None]
    assert all(s["left"] == [] for s in seen)


def _two_nodes(rank: int, world_size: int, folder: str) -> tuple:
    """Two nodes, so a rank's peer and source are the same rank: one group, both ways."""
    link = build_peer_link(rank, world_size, local_world_size=1)
    assert link is not None
    tier = MemoryTier(Path(folder) / f"node{rank}" / "run", rank, peer=link)
    tier.save(2, _state(rank, 2))
    tier.wait()
    kept = torch.load(tier._file(2, link.source), weights_only=True)["weight"]
    # A second run in the same world (a process that trains runs in turn) links again.
    again = build_peer_link(rank, world_size, local_world_size=1)
    assert again is not None
    second = MemoryTier(Path(folder) / f"node{rank}" / "second", rank, peer=again)
    second.save(4, _state(rank, 4))
    second.wait()
    assert second.steps(again.source) == [4]
    return (
        link.peer,
        link.source,
        len(link.pairs),
        torch.equal(kept, _state(1 - rank, 2)["weight"]),
    )


def test_two_nodes_keep_each_others_copies_over_one_group(tmp_path):
    assert run_distributed(_two_nodes, 2, str(tmp_path)) == [(1, 1, 1, True), (0, 0, 1, True)]
