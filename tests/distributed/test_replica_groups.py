"""Replica groups on torchft, end to end: two groups of one process on CPU (gloo), one
killed with SIGKILL and relaunched, both killed, and the losses and data of each run
against the uninterrupted run's."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import random
import signal

import numpy as np
import pytest
import torch

from examples.chat_conversations import prompt_row
from kempnerforge.config.loader import load_config
from kempnerforge.data.chat import load_chat_template
from kempnerforge.data.prepare import write_prompts_corpus
from kempnerforge.data.tokenizer import load_tokenizer
from kempnerforge.metrics.goodput import account_file
from kempnerforge.resilience.exit_codes import PREEMPTED
from kempnerforge.training.replicas.participation import HEALS_KEY, PARTICIPATION_KEY
from tests.support.chat_files import write_conversations
from tests.support.data_files import write_token_dir
from tests.support.metrics_rows import read_rows, train_rows
from tests.support.replica_groups import (
    DEBUG,
    DEBUG_MOE,
    ReplicaJob,
    child_pids,
    kill,
    losses,
    replica_steps,
)
from tests.support.tiny import tiny_run
from tests.support.tolerance import layout_atol

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs the ft extra"),
]

MAX_STEPS = 24
NUM_SLOTS = 2  # two groups x grad_accum_steps 1
SEQ_LEN, TOKENS = 32, NUM_SLOTS * 4 * 32
"""A window's length, and the tokens of a step's global batch (4 sequences a slot)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("replica-data")
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 250, size=int(rng.integers(20, 200))).tolist() for _ in range(300)]
    return write_token_dir(root / "train", docs), write_token_dir(root / "eval", docs[:20])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data) -> dict[int, float]:
    """The losses of the two groups trained side by side without a fault."""
    job = tmp_path_factory.mktemp("uninterrupted")
    with ReplicaJob(job, data, f"--train.max_steps={MAX_STEPS}") as run:
        run.start(0, 1)
        run.finish()
    first, second = losses(job / "replica_0"), losses(job / "replica_1")
    for step in first.keys() & second.keys():  # the two groups log the same global loss
        assert first[step] == pytest.approx(second[step], rel=1e-12)
    result = {**first, **second}
    assert sorted(result) == list(range(1, MAX_STEPS + 1))
    return result


def _assert_same_losses(run: dict[int, float], reference: dict[int, float]) -> None:
    """A group that steps alone sums both slots in one process, the pair all-reduces them:
    fp32 reordering of the model's chain, the global batch's tokens and the updates before
    each step (layout_atol; step s is logged after s - 1 updates)."""
    assert run, "no steps logged"
    model = load_config(DEBUG, tiny_run(None, None, "--model.n_kv_heads=2")).model
    for step, loss in run.items():
        atol = layout_atol(
            model, SEQ_LEN, tokens=TOKENS, updates=step - 1, magnitude=reference[step]
        )
        assert loss == pytest.approx(reference[step], abs=atol), step


def _assert_each_window_once(job: pathlib.Path, survivor: int, groups: tuple[int, ...]) -> None:
    """The survivor committed every data step from its first to MAX_STEPS-1 once, in order
    (from 0 when it started first); every group
    read the slots its quorum gave it (slot k to participant k % n), and no two groups of
    one quorum read the same slot.

    (A group may also step alone while the other's first quorum forms: then it reads
    every slot, and the other, starting from the same state, computes the same step.)
    """
    timeline = [e["data_step"] for e in replica_steps(job / f"replica_{survivor}")]
    assert timeline == list(range(timeline[0], MAX_STEPS))  # from its first quorum on
    _assert_slots_split(job, groups)


def _assert_slots_split(job: pathlib.Path, groups: tuple[int, ...]) -> None:
    """Every group read the slots its quorum gave it, and no two groups of one quorum the
    same slot."""
    ranks: dict[int, list[int]] = {}
    for g in groups:
        for event in replica_steps(job / f"replica_{g}"):
            n, rank = event["participants"], event["rank"]
            assert event["slots"] == list(range(rank, NUM_SLOTS, n))
            if n == 2:
                ranks.setdefault(event["data_step"], []).append(rank)
    assert all(len(set(r)) == len(r) for r in ranks.values()), ranks


def test_a_killed_group_is_left_out_and_a_relaunched_one_rejoins_from_its_peer(
    tmp_path, data, uninterrupted
):
    with ReplicaJob(tmp_path, data, f"--train.max_steps={MAX_STEPS}") as run:
        # Group 0 takes the first step alone, so it is the one that sees every step; group 1
        # joins it with its live state, and is the one killed.
        run.start(0)
        run.wait_for_step(0, 1)
        run.start(1)
        run.wait_for_step(1, 4)
        kill(run.groups[1])
        run.wait_for_step(0, 7)  # the survivor goes on alone
        run.start(1)
        run.finish()
    survivor = losses(tmp_path / "replica_0")
    assert sorted(survivor) == list(range(1, MAX_STEPS + 1))
    _assert_same_losses(survivor, uninterrupted)
    _assert_same_losses(losses(tmp_path / "replica_1"), uninterrupted)
    alone = [e for e in replica_steps(tmp_path / "replica_0") if e["participants"] == 1]
    assert alone and all(e["slots"] == [0, 1] for e in alone)  # it took the whole batch
    relaunched = run.log(1)
    assert "with a peer's live state (not read from disk)" in relaunched, relaunched[-3000:]
    _assert_each_window_once(tmp_path, 0, (0, 1))
    # Both launches of group 1 joined at the peer's step: goodput counts no step it did not
    # train and none twice.
    joined = [r for r in read_rows(tmp_path / "replica_1") if r.get("event") == "replica_joined"]
    assert len(joined) == 2
    report = account_file(tmp_path / "replica_1" / "metrics.jsonl")
    assert report.num_processes == 2 and report.seconds["recomputed"] == 0.0


def test_both_groups_killed_resume_from_the_last_checkpoint_exactly(tmp_path, data, uninterrupted):
    checkpoints = tmp_path / "checkpoints"
    extra = (f"--train.max_steps={MAX_STEPS}", "--checkpoint.interval=5")
    with ReplicaJob(tmp_path, data, *extra) as run:
        run.start(0, 1)
        run.wait_for_step(0, 7)
        for process in run.groups.values():
            kill(process)
        assert (checkpoints / "latest").read_text().strip() == "step_5"
        run.start(0, 1)
        run.finish()
    for g in (0, 1):
        _assert_same_losses(losses(tmp_path / f"replica_{g}"), uninterrupted)
    assert (checkpoints / "latest").read_text().strip() == f"step_{MAX_STEPS}"
    assert sorted(p.name for p in checkpoints.iterdir() if p.name.startswith("step_")) == [
        "step_10", "step_15", "step_20", f"step_{MAX_STEPS}", "step_5",
    ]  # fmt: skip


def test_a_stalled_group_falls_behind_and_catches_up_with_its_peers_state(
    tmp_path, data, uninterrupted
):
    with ReplicaJob(tmp_path, data, f"--train.max_steps={MAX_STEPS}") as run:
        run.start(0)
        run.wait_for_step(0, 1)
        run.start(1)
        run.wait_for_step(1, 1)
        run.groups[1].send_signal(signal.SIGSTOP)  # a hung node: no heartbeat, no collective
        stalled_at = max(losses(run.run_dir(1), live=True))
        run.wait_for_step(0, stalled_at + 4)
        run.groups[1].send_signal(signal.SIGCONT)
        run.finish()
    _assert_same_losses(losses(tmp_path / "replica_0"), uninterrupted)
    behind = losses(tmp_path / "replica_1")
    _assert_same_losses(behind, uninterrupted)
    rejoined = [
        r for r in read_rows(tmp_path / "replica_1") if r.get("event") == "replica_rejoined"
    ]
    assert rejoined, run.log(1)[-3000:]
    assert MAX_STEPS in behind  # it caught up and trained to the end
    assert account_file(tmp_path / "replica_1" / "metrics.jsonl").seconds["replica_heal"] > 0
    _assert_each_window_once(tmp_path, 0, (0, 1))


def test_a_group_of_two_fsdp_processes_losing_one_rejoins_rank_by_rank(
    tmp_path, data, uninterrupted
):
    """Groups of two processes (FSDP inside each): one rank of group 1 is killed, its
    torchrun ends the group, and the relaunched group takes each rank's shards from the
    same rank of group 0. The global batch is the same as the one-process groups' (batch
    size 2 per rank), so the losses match the uninterrupted run's."""
    extra = (f"--train.max_steps={MAX_STEPS}", "--train.batch_size=2")
    # Two processes start slowly: a longer pause keeps group 0 going until group 1 is back.
    with ReplicaJob(tmp_path, data, *extra, processes=2, pause_s=1.5) as run:
        run.start(0, 1)
        run.wait_for_step(1, 2)
        os.kill(child_pids(run.groups[1].pid)[-1], signal.SIGKILL)  # its rank 1
        run.groups[1].wait()
        run.start(1)
        run.finish()
    survivor = losses(tmp_path / "replica_0")
    assert max(survivor) == MAX_STEPS
    _assert_same_losses(survivor, uninterrupted)
    _assert_same_losses(losses(tmp_path / "replica_1"), uninterrupted)
    assert "with a peer's live state (not read from disk)" in run.log(1)  # rank 0 logs
    _assert_each_window_once(tmp_path, 0, (0, 1))


def test_a_lighthouse_restarted_mid_run_costs_no_step(tmp_path, data, uninterrupted):
    """The lighthouse is killed at step 6 (checkpoints every 5 steps) and started again on
    its port: the groups' next quorum fails, participant 0 of the last committed quorum
    saves that step, both exit 75 (PREEMPTED), and relaunched they resume exactly there:
    no step is redone and no window read twice."""
    extra = (
        f"--train.max_steps={MAX_STEPS}",
        "--checkpoint.interval=5",
        "--fault_tolerance.quorum_timeout_s=5",
    )
    with ReplicaJob(tmp_path, data, *extra) as run:
        run.start(0, 1)
        run.wait_for_step(0, 6)
        run.restart_lighthouse()
        codes = [run.groups[g].wait(timeout=120) for g in (0, 1)]
        assert codes == [PREEMPTED, PREEMPTED], [run.log(g)[-3000:] for g in (0, 1)]
        stopped = [max(losses(run.run_dir(g))) for g in (0, 1)]
        assert stopped[0] == stopped[1] and stopped[0] > 5, stopped
        checkpoints = tmp_path / "checkpoints"
        assert (checkpoints / "latest").read_text().strip() == f"step_{stopped[0]}"
        run.start(0, 1)
        run.finish()
    lost = [
        e
        for g in (0, 1)
        for e in read_rows(tmp_path / f"replica_{g}")
        if e.get("event") == "replica_quorum_lost"
    ]
    assert sorted(e["saved"] for e in lost) == [False, True], lost  # one group saved
    steps: set[int] = set()
    data_steps: set[int] = set()
    for g in (0, 1):
        run = losses(tmp_path / f"replica_{g}")
        _assert_same_losses(run, uninterrupted)
        steps |= run.keys()
        timeline = [e["data_step"] for e in replica_steps(tmp_path / f"replica_{g}")]
        assert timeline == sorted(set(timeline)), timeline  # no data step twice
        data_steps |= set(timeline)
    assert sorted(steps) == list(range(1, MAX_STEPS + 1))
    assert sorted(data_steps) == list(range(MAX_STEPS))
    # (On the relaunch one group may step alone before the other joins with its state.)
    _assert_slots_split(tmp_path, (0, 1))


def test_a_mixtures_per_dataset_metrics_count_every_groups_share(tmp_path, data):
    """Each group logs the job's per-dataset token counts and losses: its own slots' plus
    the other group's, the same numbers in both groups' rows."""
    train, held_out = data
    mixture = (
        f'--data.datasets=[{{name = "a", path = "{train}", weight = 1.0}}, '
        f'{{name = "b", path = "{held_out}", weight = 3.0}}]'
    )
    steps = 4
    with ReplicaJob(tmp_path, (train, held_out), f"--train.max_steps={steps}") as run:
        run.args = [a for a in run.args if not a.startswith("--data.path=")] + [mixture]
        run.start(0, 1)
        run.finish()
    rows = [{r["step"]: r for r in train_rows(run.run_dir(g))} for g in (0, 1)]
    tokens_per_step = NUM_SLOTS * 4 * 32  # slots x batch_size x seq_len (tiny_run)
    # (A group that joins with a peer's live state logs from its first step on.)
    assert sorted(rows[0].keys() | rows[1].keys()) == list(range(1, steps + 1))
    for step, row in (rows[0] | rows[1]).items():
        assert row["tokens/a"] + row["tokens/b"] == tokens_per_step, row
        if step in rows[0] and step in rows[1]:
            for key in ("tokens/a", "tokens/b", "loss/a", "loss/b"):
                assert rows[0][step][key] == pytest.approx(
                    rows[1][step][key], rel=1e-12, nan_ok=True
                ), key


def test_the_sigmoid_routers_biases_move_alike_in_every_group(tmp_path, data, monkeypatch):
    """The bias step reads the job's expert load (summed over the groups before the step
    commits), not the group's share, so the two groups' biases stay bitwise equal; the
    router metrics are the job's too."""
    monkeypatch.setenv("KF_TEST_BIAS_DIR", str(tmp_path))
    steps = 5
    extra = (
        f"--train.max_steps={steps}",
        "--model.moe_router=sigmoid",
        "--model.moe_aux_loss_weight=0",
        "--model.moe_expert_hidden_dim=32",
        "--model.moe_bias_update_rate=0.01",
        "--train.hooks=['tests.support.replica_groups:SlowSteps', "
        "'tests.support.replica_groups:RouterBiases']",
    )
    with ReplicaJob(tmp_path, data, *extra) as run:
        run.args[0] = DEBUG_MOE
        run.start(0, 1)
        run.finish()
    both = 0
    for step in range(1, steps + 1):
        saved = [tmp_path / f"g{g}-step{step}.pt" for g in (0, 1)]
        if not all(path.exists() for path in saved):
            continue  # a group that joined with its peer's state took its first steps there
        first, second = (torch.load(path, weights_only=True) for path in saved)
        assert len(first) == 2 and any(bool(b.abs().sum() > 0) for b in first)
        for a, b in zip(first, second, strict=True):
            assert torch.equal(a, b), step
        both += 1
    assert both >= 3
    rows = [{r["step"]: r for r in train_rows(run.run_dir(g))} for g in (0, 1)]
    tokens_per_step = NUM_SLOTS * 4 * 32 * 2  # slots x batch x seq x top-2 assignments
    for step in rows[0].keys() & rows[1].keys():
        assert rows[0][step]["moe/load"] == rows[1][step]["moe/load"]
        assert sum(map(sum, rows[0][step]["moe/load"])) == 2 * tokens_per_step  # 2 layers


def test_groups_that_miss_quorums_show_in_participation_and_one_warning(tmp_path, data):
    """Three groups and a lighthouse that forms each quorum as soon as two groups asked
    (join timeout 0): the third, alive, keeps missing quorums and healing from a peer.
    Participation falls, heals per hour rise, and each group that sees it warns in one
    line, not once a step (a window of 6 steps: at most one line per 6 steps)."""
    steps, window = 24, 6
    extra = (
        f"--train.max_steps={steps}",
        f"--fault_tolerance.participation_window={window}",
        "--fault_tolerance.participation_warn_below=0.9",
    )
    with ReplicaJob(tmp_path, data, *extra, num_groups=3, join_timeout_ms=0, pause_s=0.1) as run:
        run.start(0, 1, 2)
        run.finish()
    rows = [train_rows(run.run_dir(g)) for g in (0, 1, 2)]
    shares = [r[PARTICIPATION_KEY] for group in rows for r in group if PARTICIPATION_KEY in r]
    assert shares and min(shares) < 0.9, shares
    assert max(r.get(HEALS_KEY, 0.0) for group in rows for r in group) > 0
    warning = "replica groups in their quorum (fault_tolerance.participation_warn_below"
    said = [run.log(g).count(warning) for g in (0, 1, 2)]
    assert sum(said) >= 1, [run.log(g)[-2000:] for g in (0, 1, 2)]
    assert all(n <= steps // window for n in said), said


GRPO_STEPS = 10


def test_grpo_groups_sample_each_prompt_once_through_a_kill_and_rejoin(tmp_path):
    """GRPO's prompts are the slots: each group samples the completions of the slots its
    quorum assigned (seeded by the prompt, the data step and the completion's number), so
    a group that steps alone samples both slots' completions as the pair does, and a killed
    and relaunched group rejoins from its peer: the losses are the uninterrupted pair's and
    every step's slots are read once."""
    rows = [prompt_row(random.Random(seed)) for seed in range(64)]
    source = write_conversations(tmp_path / "prompts.jsonl", rows)
    prompts = tmp_path / "prompts"
    write_prompts_corpus(
        [str(source)], str(prompts), load_tokenizer("byte"), load_chat_template("byte"), 64
    )
    grpo = (
        f"--train.max_steps={GRPO_STEPS}", "--train.seq_len=64", "--model.max_seq_len=64",
        "--train.loss_fn=grpo", "--grpo.group_size=4", "--grpo.max_new_tokens=6",
        "--grpo.reward=tests.support.rewards:digits", "--optimizer.lr=1e-2",
    )  # fmt: skip
    data = (str(prompts), "")
    together, faulty = tmp_path / "together", tmp_path / "faulty"
    together.mkdir()
    faulty.mkdir()
    with ReplicaJob(together, data, *grpo) as run:
        run.start(0, 1)
        run.finish()
    reference = {**losses(together / "replica_0"), **losses(together / "replica_1")}
    assert sorted(reference) == list(range(1, GRPO_STEPS + 1))

    with ReplicaJob(faulty, data, *grpo) as run:
        run.start(0)
        run.wait_for_step(0, 1)
        run.start(1)
        run.wait_for_step(1, 3)
        kill(run.groups[1])
        run.wait_for_step(0, 5)
        run.start(1)
        run.finish()
        assert "with a peer's live state (not read from disk)" in run.log(1)
    survivor = losses(faulty / "replica_0")
    assert sorted(survivor) == list(range(1, GRPO_STEPS + 1))
    model = load_config(DEBUG, tiny_run(None, None, "--model.n_kv_heads=2")).model
    for step, loss in survivor.items():
        # One group summing both slots against the pair all-reducing them: fp32 reordering
        # of the chain over the step's completion tokens (at most 2 slots x 4 x 64).
        atol = layout_atol(model, 64, tokens=2 * 4 * 64, updates=step - 1, magnitude=1.0)
        assert loss == pytest.approx(reference[step], abs=atol), step
    timeline = [e["data_step"] for e in replica_steps(faulty / "replica_0")]
    assert timeline == list(range(timeline[0], GRPO_STEPS))
    _assert_slots_split(faulty, (0, 1))
