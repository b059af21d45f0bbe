"""The memory tier in one process: copies of the training state in a folder standing for the
node's shared memory every checkpoint.memory_interval steps, the newest two kept; a run that
crashes between persistent checkpoints resumes from the newest copy and trains to the same
losses, bitwise, as a run that did not crash; a finished run leaves no copy behind."""

from __future__ import annotations

import threading

import pytest

from kempnerforge.checkpoint.memory_peer import agree_newest, peer_ranks
from kempnerforge.checkpoint.memory_tier import MemoryTier, agreed_step
from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.metrics.goodput import account_file
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import events, train_rows
from tests.support.tiny import tiny_run


class Crash(RuntimeError):
    pass


def crash_in_step_8(step_fn):
    """The step body, raising in its 8th call (step 8, after step 7 is logged)."""
    calls = []

    def step(session, number):
        calls.append(number)
        if len(calls) == 8:
            raise Crash("the process dies here")
        return step_fn(session, number)

    return step


def _config(tmp_path, name: str, memory):
    return load_config(
        None,
        tiny_run(
            tmp_path / name, None, "--train.max_steps=10", "--train.deterministic=true",
            "--checkpoint.memory_interval=2", f"--checkpoint.memory_dir={memory}",
            "--checkpoint.interval=0", "--optimizer.lr=3e-3", "--eval.interval=0",
        ),
    )  # fmt: skip


def test_a_crashed_run_resumes_from_the_newest_copy_in_memory(tmp_path):
    memory = tmp_path / "shm"
    whole = _config(tmp_path, "whole", memory)
    session = build_session(whole, RuntimeContext())
    run_training_loop(session)
    session.tracker.close()
    assert not any(memory.iterdir()), "a finished run removes its copies"

    crashed = _config(tmp_path, "crashed", memory)
    session = build_session(crashed, RuntimeContext())
    session.step_fn = crash_in_step_8(session.step_fn)
    with pytest.raises(Crash):
        run_training_loop(session)
    session.tracker.close()
    tier = session.memory_tier
    assert tier is not None
    tier.wait()
    assert tier.steps() == [4, 6]  # every 2 steps, the newest 2 kept
    assert agreed_step(tier, None) == 6
    assert not (tmp_path / "crashed" / "checkpoints").exists()  # nothing persistent yet

    relaunch = build_session(crashed, RuntimeContext())
    step, tokens_seen = resume_session(relaunch)
    assert step == 6
    run_training_loop(relaunch, step=step, tokens_seen=tokens_seen)
    relaunch.tracker.close()
    want = {r["step"]: r for r in train_rows(whole.run_dir)}
    got = {r["step"]: r for r in train_rows(crashed.run_dir)}  # step 7 logged twice: the last
    assert sorted(got) == list(range(1, 11))
    for s in range(1, 11):
        assert (got[s]["loss"], got[s]["grad_norm"]) == (want[s]["loss"], want[s]["grad_norm"]), s
    (resume,) = events(crashed.run_dir, "resume")
    assert "memory tier" in resume["path"] and resume["step"] == 6
    copies = events(crashed.run_dir, "memory_copy")
    assert [e["step"] for e in copies] == [2, 4, 6, 8]  # step 10 is the end's checkpoint
    assert all(e["seconds"] >= 0 for e in copies)
    # The loop's blocked seconds count as checkpoint time in the goodput account.
    report = account_file(crashed.run_dir + "/metrics.jsonl")
    assert report.seconds["checkpoint"] >= sum(e["seconds"] for e in copies)


def test_a_copy_half_written_is_not_one(tmp_path):
    tier = MemoryTier(tmp_path, rank=0)
    tier.save(3, {"x": 1})
    tier.wait()
    (tmp_path / "step_5").mkdir()
    (tmp_path / "step_5" / "rank_0.pt.tmp").write_bytes(b"torn")
    assert tier.steps() == [3]
    assert tier.load(3) == {"x": 1}


def _agree_in_lockstep(held: list[list[int]]) -> tuple[list[int | None], int]:
    """agree_newest on one thread per simulated rank, ``all_min`` a real minimum over them
    all; returns each rank's answer and the all-reduces each rank made."""
    world = len(held)
    values = [0] * world
    counts = [0] * world
    barrier = threading.Barrier(world)
    answers: list[int | None] = [None] * world

    def rank(r: int) -> None:
        def all_min(value: int) -> int:
            counts[r] += 1
            values[r] = value
            barrier.wait()
            smallest = min(values)
            barrier.wait()  # everyone has read it before the next round writes
            return smallest

        answers[r] = agree_newest(held[r], all_min)[0]

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(counts)) == 1
    return answers, counts[0]


@pytest.mark.parametrize(
    ("pattern", "want"),
    [
        ("in step", 12),  # every rank holds 10 and 12
        ("one rank behind", 10),  # rank 7 has not copied 12 yet
        ("one rank ahead", 12),  # rank 7 already holds 14
        ("a lost node", 10),  # rank 5 reaches only 8 and 10 (its peer's copies)
        ("nothing in common", None),
    ],
)
def test_1024_ranks_agree_on_the_newest_step_all_hold_in_a_few_all_reduces(pattern, want):
    held = [[10, 12] for _ in range(1024)]
    if pattern == "one rank behind":
        held[7] = [8, 10]
    elif pattern == "one rank ahead":
        held[7] = [12, 14]
    elif pattern == "a lost node":
        held[5] = [8, 10]
        held[900] = [10, 12, 14]
    elif pattern == "nothing in common":
        held[3] = [2, 4]
    answers, all_reduces = _agree_in_lockstep(held)
    assert answers == [want] * 1024
    # The newest common step, by brute force over every rank's list.
    common = set.intersection(*(set(h) for h in held))
    assert want == (max(common) if common else None)
    # Two all-reduces of one number a round, a round per step proposed: never the world.
    assert all_reduces <= 2 * len(set().union(*map(set, held)))
    assert all_reduces <= 6


def test_a_peer_is_the_same_local_rank_on_the_next_node():
    # 3 nodes of 4 ranks: rank 5 (node 1, local 1) sends to 9 and keeps 1's copies.
    assert peer_ranks(5, 12, 4) == (9, 1)
    assert peer_ranks(9, 12, 4) == (1, 5)
    # One node, or nodes of unequal sizes: no peer copies.
    assert peer_ranks(1, 4, 4) is None
    assert peer_ranks(1, 6, 4) is None
