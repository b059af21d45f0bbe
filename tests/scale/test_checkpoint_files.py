"""At 1,024 ranks a rank still opens only its own share of a checkpoint plus O(1) shared files.

Simulated: checkpoints as 64 and as 1,024 ranks would have saved them (tests/support/
fake_world.py), and the file accesses of one rank counted while it plans a resume (the
agreement of the other ranks is a function given to the verdict, the collective a job
runs there) and while rank 0 applies retention at a commit. The counts must not depend on
the world size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kempnerforge.checkpoint.choice import choose, list_candidates
from kempnerforge.checkpoint.disk_format import write_latest
from kempnerforge.checkpoint.integrity import share_problems
from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from tests.support.fake_world import count_file_access, write_fake_checkpoint
from tests.unit.test_checkpoint import _save

WORLDS = (64, 1024)
STEPS = (10, 20, 30)
PER_RANK = ("train_state_rank", "checksums_rank", ".distcp")


def _own_files(rank: int) -> list[str]:
    """The files rank `rank` opens to judge a checkpoint: two shared, three its own."""
    own = [f"__{rank}_0.distcp", f"checksums_rank{rank}.json", f"train_state_rank{rank}.pt"]
    return sorted([".metadata", "complete.json", *own])


def _saved_run(root: Path, world_size: int) -> Path:
    directory = root / f"world{world_size}"
    for step in STEPS:
        write_fake_checkpoint(directory, step, world_size)
    write_latest(directory, f"step_{STEPS[-1]}")
    return directory


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("scale")
    return {world: _saved_run(root, world) for world in WORLDS}


def _verdict(rank: int, world_size: int, others: dict[str, str]) -> Callable[[Path], list[str]]:
    """CheckpointManager.verify on rank `rank`, the agreement replaced: the other ranks
    find the problems `others` names (by checkpoint name), or none."""

    def verdict(path: Path) -> list[str]:
        mine = share_problems(path, rank, world_size)
        return mine or ([others[path.name]] if path.name in others else [])

    return verdict


def _plan_resume(directory: Path, rank: int, world_size: int, others: dict[str, str]) -> str:
    """What CheckpointManager.find_resume_path does on rank `rank` for 'auto'."""
    candidates = list_candidates(directory, "auto")  # rank 0's listing, sent to every rank
    assert candidates is not None
    found = choose(candidates, _verdict(rank, world_size, others), quiet=True)
    assert found is not None
    return found


@pytest.mark.parametrize("role", ["first", "middle", "last"])
def test_a_rank_judges_a_checkpoint_by_its_own_files_whatever_the_world_size(
    runs, monkeypatch, role
):
    counts = {}
    for world, directory in runs.items():
        rank = {"first": 0, "middle": 37, "last": world - 1}[role]
        candidates = list_candidates(directory, "auto")
        assert candidates is not None
        with count_file_access(monkeypatch, directory) as access:
            found = choose(candidates, _verdict(rank, world, {}), quiet=True)
        assert found == str(directory / "step_30")
        assert access.names() == _own_files(rank)
        assert sum(access.stats.values()) == 1  # the checkpoint directory itself
        counts[world] = (sum(access.opens.values()), sum(access.stats.values()))
    assert counts[64] == counts[1024] == (5, 1)


def test_each_candidate_auto_tries_costs_one_pass_over_the_ranks_own_files(runs, monkeypatch):
    counts = {}
    for world, directory in runs.items():
        rank = world - 1
        damaged = {"step_30": "__3_0.distcp does not match its checksum in checksums_rank3.json"}
        with count_file_access(monkeypatch, directory) as access:
            found = _plan_resume(directory, rank, world, damaged)
        assert found == str(directory / "step_20")
        mine = _own_files(rank)
        assert access.names() == sorted(["latest", *mine, *mine])  # step_30, then step_20
        counts[world] = (sum(access.opens.values()), sum(access.stats.values()))
    assert counts[64] == counts[1024]


def test_a_rank_reads_its_share_when_the_world_shrank(runs, monkeypatch):
    """Saved by 1,024 ranks, judged by rank 5 of 64: 16 writers' files, no more."""
    with count_file_access(monkeypatch, runs[1024]) as access:
        assert share_problems(runs[1024] / "step_30", 5, 64) == []
    writers = range(5, 1024, 64)
    assert access.names() == sorted(
        [".metadata", "complete.json", "train_state_rank5.pt"]
        + [f"__{w}_0.distcp" for w in writers]
        + [f"checksums_rank{w}.json" for w in writers]
    )


def test_retention_reads_one_marker_per_checkpoint_it_did_not_write(tmp_path, monkeypatch):
    counts = {}
    for world in WORLDS:
        directory = _saved_run(tmp_path, world)
        manager = CheckpointManager(CheckpointConfig(keep_last_n=2), str(directory))
        with count_file_access(monkeypatch, directory) as access:
            _save(manager, 40)  # commits, then rank 0 applies retention over step_10..40
        assert sorted(p.name for p in directory.iterdir()) == ["latest", "step_30", "step_40"]
        old = {p: n for p, n in access.opens.items() if not p.startswith(("step_40", "latest"))}
        assert not [p for p in old if any(k in p for k in PER_RANK + (".metadata",))]
        assert sorted(p for p in old if p.endswith("complete.json")) == [
            f"step_{step}/complete.json" for step in STEPS
        ]
        counts[world] = (dict(old), dict(access.stats))
    assert counts[64] == counts[1024]
