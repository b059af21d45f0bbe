"""The real build and loop on two gloo ranks, in every layout, against one process.

Every layout trains the same global batch from the same seed, so its per-step loss and
gradient norm must match a single-process run within layout_atol: only the order of
floating-point sums differs (reductions over ranks, sharded matmuls).
"""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from tests.support.metrics_rows import eval_rows, train_rows
from tests.support.tiny import SIGMOID_MOE, layout_run
from tests.support.tolerance import assert_layout_close, grad_norm_terms
from tests.support.train_run import train_ranks

pytestmark = pytest.mark.distributed

STEPS = 4
SEQ_LEN, TOKENS = 32, 4 * 32
"""A window's length, and the tokens of a step's global batch (4 sequences) that its loss
averages."""


@pytest.fixture(scope="module")
def base(token_dirs) -> list[str]:
    return layout_run(token_dirs, STEPS, "--model.n_layers=4", "--data.document_masking=false")


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> dict:
    """One process, 4 sequences per step in one micro-batch: what every layout must match
    (a pipeline's 2 micro-batches of 2 hold the same sequences)."""
    return _one_process(base, tmp_path_factory.mktemp("one"), "--train.batch_size=4")


def _one_process(base: list[str], run_dir, *extra: str, **kwargs) -> dict:
    return train_ranks(base, run_dir, 1, *extra, **kwargs)[0]


def _two_ranks(base: list[str], run_dir, *extra: str, **kwargs) -> list[dict]:
    return train_ranks(base, run_dir, 2, *extra, **kwargs)


def _assert_losses(got: list[float], want: list[float], base: list[str], first: int = 0) -> None:
    """Losses from step ``first`` on, within fp32 reordering of the model's chain of sums,
    the batch's tokens and the updates before each step (layout_atol)."""
    model = load_config(None, base).model
    assert_layout_close(got, want, first_update=first, cfg=model, seq_len=SEQ_LEN, tokens=TOKENS)


def _assert_matches(ranks: list[dict], reference: dict, base: list[str]) -> None:
    for record in ranks:
        # Every rank reports the same global numbers, whatever part of the model it holds.
        assert record["losses"] == ranks[0]["losses"]
        assert record["grad_norms"] == ranks[0]["grad_norms"]
        assert len(record["losses"]) == len(reference["losses"]) == STEPS
    _assert_losses(ranks[0]["losses"], reference["losses"], base)
    config = load_config(None, base)
    assert_layout_close(
        ranks[0]["grad_norms"],
        reference["grad_norms"],
        cfg=config.model,
        seq_len=SEQ_LEN,
        tokens=TOKENS,
        norm_terms=grad_norm_terms(config),
    )


@pytest.mark.parametrize(
    ("layout", "per_rank", "accum"),
    [
        (["--distributed.dp_shard=2"], 2, 1),
        (["--distributed.dp_shard=2"], 1, 2),  # gradient sync deferred to the last micro-batch
        (["--distributed.dp_replicate=2", "--distributed.dp_shard=1"], 2, 1),
        (["--distributed.tp=2", "--distributed.dp_shard=1"], 4, 1),
    ],
    ids=["fsdp", "fsdp-accumulate", "hsdp-replicate", "tp"],
)
def test_a_layout_trains_like_one_process(
    base, reference, tmp_path, layout, per_rank, accum
) -> None:
    split = [f"--train.batch_size={per_rank}", f"--train.grad_accum_steps={accum}"]
    ranks = _two_ranks(base, tmp_path / "two", *layout, *split)
    _assert_matches(ranks, reference, base)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_a_pipeline_trains_like_one_process_and_every_stage_reports_the_loss(
    base, reference, tmp_path, schedule
) -> None:
    batch = ["--train.batch_size=2", "--train.grad_accum_steps=2"]
    layout = [
        "--distributed.pp=2",
        "--distributed.dp_shard=1",
        f"--distributed.pp_schedule={schedule}",
    ]
    # Stages have no whole-model forward: in-loop eval is skipped (the build warns).
    ranks = _two_ranks(base, tmp_path / "two", *layout, *batch, "--eval.interval=2")
    _assert_matches(ranks, reference, base)
    assert not eval_rows(tmp_path / "two")
    # Rank 0's rows count the tokens of every rank, per device too.
    train = train_rows(tmp_path / "two")
    assert len(train) == STEPS
    for row in train:
        assert row["peak_memory_gib"] > 0 and row["skipped_steps"] == 0
        assert row["tokens_per_sec_per_device"] == pytest.approx(row["tokens_per_sec"] / 2)


TIED = ["--model.tie_embeddings=true"]
PIPELINE = ["--distributed.pp=2", "--distributed.dp_shard=1"]
MICRO = ["--train.batch_size=2", "--train.grad_accum_steps=2"]


@pytest.fixture(scope="module")
def tied_reference(base, tmp_path_factory) -> dict:
    return _one_process(base, tmp_path_factory.mktemp("tied-one"), *TIED, "--train.batch_size=4")


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_a_tied_head_on_the_last_stage_trains_like_the_one_tied_weight(
    base, tied_reference, tmp_path, schedule
) -> None:
    """The embedding on stage 0 and the head on the last stage, two ranks apart (also with
    two stages a rank): two copies that sum their gradients (distributed/tied_head.py)
    train as the whole model's one weight."""
    layout = [*PIPELINE, f"--distributed.pp_schedule={schedule}"]
    ranks = _two_ranks(base, tmp_path / "two", *TIED, *layout, *MICRO)
    _assert_matches(ranks, tied_reference, base)


@pytest.mark.parametrize("pipelined_first", [True, False], ids=["pp-to-one", "one-to-pp"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_checkpoint_resumes_between_pipeline_stages_and_one_process(
    base, reference, tied_reference, tmp_path, pipelined_first, tied
) -> None:
    """Each stage loads its own layers of a whole model's checkpoint, and one process
    loads every stage's. A tied weight's optimizer state is in the checkpoint once, under
    the embedding's name, whichever layout wrote it: the head's copy on a pipeline rank
    reads it from there, and one process reads what the pipeline's copies wrote."""
    run, model = tmp_path / "run", TIED if tied else []
    if pipelined_first:
        _two_ranks(base, run, *model, *PIPELINE, *MICRO, "--train.max_steps=2")
        resumed = [_one_process(base, run, *model, "--train.batch_size=4")]
    else:
        _one_process(base, run, *model, "--train.batch_size=4", "--train.max_steps=2")
        resumed = _two_ranks(base, run, *model, *PIPELINE, *MICRO)
    assert {r["start_step"] for r in resumed} == {2}
    want = (tied_reference if tied else reference)["losses"][2:]
    _assert_losses(resumed[0]["losses"], want, base, first=2)
    assert all(r["grad_norms"] == resumed[0]["grad_norms"] for r in resumed)


def test_a_run_resumed_on_one_process_sees_the_samples_the_two_rank_run_would_have(
    base, tmp_path
) -> None:
    """dp_shard = 2 saves at step 2; one process resumes it with the same global batch."""
    run = tmp_path / "run"
    whole = _two_ranks(base, tmp_path / "whole", "--train.batch_size=2", record_batches=True)
    _two_ranks(base, run, "--train.batch_size=2", "--train.max_steps=2")
    resumed = _one_process(base, run, "--train.batch_size=4", record_batches=True)
    assert resumed["start_step"] == 2
    assert resumed["step"] == STEPS
    # The exact samples: step s's batch on one process holds rank 0's and rank 1's rows.
    for step, batch in zip(range(2, STEPS), resumed["batches"], strict=True):
        rows = torch.cat([whole[0]["batches"][step], whole[1]["batches"][step]])
        assert sorted(map(tuple, batch.tolist())) == sorted(map(tuple, rows.tolist()))
    _assert_losses(resumed["losses"], whole[0]["losses"][2:], base, first=2)


@pytest.mark.parametrize(
    ("saved", "resumed_layout"),
    [
        (
            ["--distributed.dp_shard=2", "--train.batch_size=2"],
            ["--distributed.tp=2", "--distributed.dp_shard=1", "--train.batch_size=4"],
        ),
        (
            ["--distributed.tp=2", "--distributed.dp_shard=1", "--train.batch_size=4"],
            ["--distributed.dp_shard=2", "--train.batch_size=2"],
        ),
    ],
    ids=["fsdp-to-tp", "tp-to-fsdp"],
)
def test_a_checkpoint_resumes_on_another_layout(
    base, reference, tmp_path, saved, resumed_layout
) -> None:
    run = tmp_path / "run"
    _two_ranks(base, run, *saved, "--train.max_steps=2")
    resumed = _two_ranks(base, run, *resumed_layout)
    assert [r["start_step"] for r in resumed] == [2, 2]
    _assert_losses(resumed[0]["losses"], reference["losses"][2:], base, first=2)


MUON = ["--optimizer.name=muon", "--optimizer.lr=0.02", "--optimizer.muon_adam_lr=2e-3"]


@pytest.fixture(scope="module")
def muon_reference(base, tmp_path_factory) -> dict:
    return _one_process(base, tmp_path_factory.mktemp("muon-one"), *MUON, "--train.batch_size=4")


@pytest.mark.parametrize(
    "resumed_layout",
    [
        ["--distributed.dp_shard=1", "--distributed.dp_replicate=1", "--train.batch_size=4"],
        ["--distributed.tp=2", "--distributed.dp_shard=1", "--train.batch_size=4"],
    ],
    ids=["fsdp-to-one", "fsdp-to-tp"],
)
def test_a_muon_checkpoint_resumes_on_another_layout(
    base, muon_reference, tmp_path, resumed_layout
) -> None:
    """Saved with FSDP over 2 ranks (each matrix's momentum in row shards), resumed on one
    process and under tensor parallelism (the same momentum cut by columns for wo and w2):
    the run goes on as the one-process run did."""
    run = tmp_path / "run"
    _two_ranks(
        base, run, *MUON, "--distributed.dp_shard=2", "--train.batch_size=2", "--train.max_steps=2"
    )
    count = 1 if "--distributed.dp_replicate=1" in resumed_layout else 2
    resumed = train_ranks(base, run, count, *MUON, *resumed_layout)
    assert [r["start_step"] for r in resumed] == [2] * count
    _assert_losses(resumed[0]["losses"], muon_reference["losses"][2:], base, first=2)


def test_one_process_resumes_onto_two_ranks(base, reference, tmp_path) -> None:
    run = tmp_path / "run"
    _one_process(base, run, "--train.batch_size=4", "--train.max_steps=2")
    resumed = _two_ranks(base, run, "--distributed.dp_shard=2", "--train.batch_size=2")
    assert [r["start_step"] for r in resumed] == [2, 2]
    _assert_losses(resumed[1]["losses"], reference["losses"][2:], base, first=2)


MOE = [*SIGMOID_MOE, "--model.moe_aux_loss_weight=0.01"]


@pytest.fixture(scope="module")
def moe_reference(base, tmp_path_factory) -> dict:
    return _one_process(base, tmp_path_factory.mktemp("moe-one"), *MOE, "--train.batch_size=4")


def test_an_moe_model_with_experts_split_over_two_ranks_trains_like_one_process(
    base, moe_reference, tmp_path
) -> None:
    layout = ["--distributed.dp_shard=2", "--distributed.ep=2", "--train.batch_size=2"]
    ranks = _two_ranks(base, tmp_path / "two", *MOE, *layout)
    _assert_matches(ranks, moe_reference, [*base, *MOE])


def test_an_expert_parallel_checkpoint_resumes_on_one_process(
    base, moe_reference, tmp_path
) -> None:
    """Saved with the experts split over 2 ranks (DTensor shards) and the balancing biases
    moved; one process loads the whole experts and biases and continues the same run."""
    run = tmp_path / "run"
    layout = ["--distributed.dp_shard=2", "--distributed.ep=2", "--train.batch_size=2"]
    _two_ranks(base, run, *MOE, *layout, "--train.max_steps=2")
    resumed = _one_process(base, run, *MOE, "--train.batch_size=4")
    assert resumed["start_step"] == 2
    _assert_losses(resumed["losses"], moe_reference["losses"][2:], [*base, *MOE], first=2)
