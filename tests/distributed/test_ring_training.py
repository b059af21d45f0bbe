"""Ring attention through the real build and loop against one process: a ring of 2 and
of 4 ranks and a ring of 2 Ulysses pairs, with packed documents (document masking) and
grouped-query heads, eval, exact resume across the ring and one process, and the
end-of-run sample."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.model.attention import held_spans
from tests.support.dist import run_distributed
from tests.support.metrics_rows import eval_rows
from tests.support.tiny import layout_run
from tests.support.tolerance import assert_layout_close, grad_norm_terms
from tests.support.train_run import sample_on_ranks, train_ranks

pytestmark = pytest.mark.distributed

STEPS = 3
SEQ_LEN, TOKENS = 32, 4 * 32
"""A window's length, and the tokens of a step's global batch (4 sequences)."""
RING2 = ["--distributed.cp=2", "--distributed.dp_shard=1", "--distributed.cp_attention=ring"]
RING4 = ["--distributed.cp=4", "--distributed.dp_shard=1", "--distributed.cp_attention=ring"]
RING_OF_PAIRS = [*RING4, "--distributed.cp_ulysses=2"]


@pytest.fixture(scope="module")
def base(token_dirs) -> list[str]:
    """The tiny GQA model (4 query heads, 2 key/value heads) on packed documents."""
    return layout_run(
        token_dirs, STEPS, "--data.document_masking=true", "--eval.interval=3", "--eval.steps=2"
    )


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> dict:
    run_dir = tmp_path_factory.mktemp("one")
    record = train_ranks(base, run_dir, 1, record_batches=True)[0]
    record["eval"] = [r["eval_loss"] for r in eval_rows(run_dir)]
    return record


def _assert_matches(ranks: list[dict], reference: dict, base: list[str], steps: int) -> None:
    """Every rank logs the same numbers, within fp32 reordering of one process's."""
    for record in ranks:
        assert record["losses"] == ranks[0]["losses"]
        assert record["grad_norms"] == ranks[0]["grad_norms"]
    config = load_config(None, base)
    bound = {"first_update": len(reference["losses"]) - steps, "cfg": config.model}
    bound |= {"seq_len": SEQ_LEN, "tokens": TOKENS}
    assert_layout_close(ranks[0]["losses"], reference["losses"][-steps:], **bound)
    norms = ranks[0]["grad_norms"], reference["grad_norms"][-steps:]
    assert_layout_close(*norms, norm_terms=grad_norm_terms(config), **bound)


RECOMPUTE = [*RING2, "--distributed.activation_checkpointing=full"]


@pytest.mark.parametrize(
    ("layout", "ring"),
    [(RING2, 2), (RING4, 4), (RING_OF_PAIRS, 2), (RECOMPUTE, 2)],
    ids=["ring2", "ring4", "ring2-of-ulysses-pairs", "ring2-recompute"],
)
def test_ring_attention_trains_and_evaluates_like_one_process(
    base, reference, tmp_path, layout, ring
) -> None:
    """Each rank reads the whole batch and keeps its zigzag chunks (its rope positions and
    labels with them); the documents mask each chunk pair as one process's mask does.
    With activation checkpointing, backward recomputes each block's forward, ring
    included, on every rank in the same order."""
    world = 2 if layout in (RING2, RECOMPUTE) else 4
    ranks = train_ranks(base, tmp_path, world, *layout, record_batches=True)
    _assert_matches(ranks, reference, base, STEPS)
    whole = torch.cat(reference["batches"])
    for rank, record in enumerate(ranks):
        spans = held_spans(rank, world, SEQ_LEN, ring)
        mine = torch.cat([whole[:, a:b] for a, b in spans], dim=1)
        assert torch.equal(torch.cat(record["batches"]), mine)
    model = load_config(None, base).model
    evals = [r["eval_loss"] for r in eval_rows(tmp_path)]
    bound = {"cfg": model, "seq_len": SEQ_LEN, "tokens": 2 * TOKENS}
    assert_layout_close(evals, reference["eval"], first_update=STEPS, **bound)


@pytest.mark.parametrize(
    ("saved", "resumed", "world", "ring"),
    [(RING2, [], 1, 1), ([], RING_OF_PAIRS, 4, 2)],
    ids=["ring2-to-one-process", "one-process-to-ring-of-pairs"],
)
def test_a_checkpoint_resumes_across_ring_attention_at_the_exact_data_position(
    base, reference, tmp_path, saved, resumed, world, ring
) -> None:
    """The data order does not depend on the ring: a resume reads exactly the windows the
    uninterrupted run read next, each rank keeping its chunks of them."""
    train_ranks(base, tmp_path, 2 if saved else 1, *saved, "--train.max_steps=1")
    ranks = train_ranks(base, tmp_path, world, *resumed, record_batches=True)
    assert {r["start_step"] for r in ranks} == {1}
    _assert_matches(ranks, reference, base, STEPS - 1)
    for rank, record in enumerate(ranks):
        spans = held_spans(rank, world, SEQ_LEN, ring)
        for mine, whole in zip(record["batches"], reference["batches"][1:], strict=True):
            assert torch.equal(mine, torch.cat([whole[:, a:b] for a, b in spans], dim=1))


def test_the_end_of_run_sample_under_ring_attention_is_one_process_sample(base, tmp_path) -> None:
    """The sample decodes whole windows on every rank (no ring), after training through it."""
    sample = [
        "--train.sample_prompt=def",
        "--train.sample_tokens=12",
        "--train.max_steps=8",
        "--eval.interval=0",
        "--optimizer.lr=0.01",
    ]
    (one,) = run_distributed(
        sample_on_ranks, 1, [*base, *sample, "--train.run_dir=" + str(tmp_path / "one")]
    )
    ranks = run_distributed(
        sample_on_ranks, 2, [*base, *sample, *RING2, "--train.run_dir=" + str(tmp_path / "r")]
    )
    assert one and ranks == [one, one]
