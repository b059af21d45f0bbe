"""Pipeline parallelism: stage layout, and one step on real gloo ranks equal to one process,
with packed documents masked in every stage and sliding windows in every other layer."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.distributed.pipeline_parallel import (
    build_pipeline,
    build_stage_model,
    stage_layer_ranges,
    stages_of_rank,
)
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.loss import cross_entropy_sum
from tests.support.dist import run_distributed
from tests.support.tiny import TINY_MODEL
from tests.support.tolerance import assert_reordered_close, transformer_terms

SEED = 11
NUM_MICRO, BATCH, SEQ, VOCAB = 4, 2, 16, 64
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev")


def _config(schedule: str, dp_shard: int = 1) -> JobConfig:
    return load_config(
        None,
        [
            *TINY_MODEL,
            "--model.n_layers=4",
            "--model.n_heads=4",
            f"--model.vocab_size={VOCAB}",
            f"--model.max_seq_len={SEQ}",
            "--distributed.pp=2",
            f"--distributed.pp_schedule={schedule!r}",
            f"--distributed.dp_shard={dp_shard}",
            f"--train.grad_accum_steps={NUM_MICRO}",
            f"--train.batch_size={BATCH}",
            f"--train.seq_len={SEQ}",
            # Windows shorter than the documents below: every stage masks both.
            "--model.sliding_window=5",
            "--model.sliding_window_pattern=2",
        ],
    )


def _step_data(dp: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, labels, doc_ids), each (dp, NUM_MICRO * BATCH, SEQ): one step's micro-batches
    of every data-parallel rank, concatenated as pipeline_step does; some labels are
    ignored, and each row packs up to three documents."""
    gen = torch.Generator().manual_seed(SEED)
    shape = (dp, NUM_MICRO * BATCH, SEQ)
    inputs = torch.randint(0, VOCAB, shape, generator=gen)
    labels = torch.randint(0, VOCAB, shape, generator=gen)
    labels[torch.rand(shape, generator=gen) < 0.2] = IGNORE_INDEX
    starts = torch.rand(shape, generator=gen) < 0.15  # a document starts here
    starts[..., 0] = False
    return inputs, labels, starts.long().cumsum(-1)


def _reference(config: JobConfig, dp: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One process, the whole model: per-micro-batch summed losses and the gradients of
    their sum over the step's supervised tokens."""
    inputs, labels, doc_ids = _step_data(dp)
    model = Transformer(config.model)
    model.init_weights(SEED)
    tokens = (labels != IGNORE_INDEX).sum()
    losses = []
    for rank in range(dp):
        micro = zip(*(t[rank].split(BATCH) for t in (inputs, labels, doc_ids)), strict=True)
        for x, y, docs in micro:
            loss = cross_entropy_sum(model(x, docs), y)
            (loss / tokens).backward()
            losses.append(loss.detach())
    return losses, {name: p.grad for name, p in model.named_parameters() if p.grad is not None}


def _pipeline_steps(config: JobConfig, fsdp: bool) -> dict[str, object]:
    """Build this rank's stages as the build does and run two steps on the same batches
    (the first also infers the stages' shapes); return what to compare."""
    dc = config.distributed
    runtime = init_runtime(dc, "cpu")
    stage_ids = stages_of_rank(runtime.pp_rank, dc.pp, dc.stages_per_rank, v_shaped=dc.v_shaped)
    ranges = stage_layer_ranges(config.model.n_layers, dc.num_stages, dc.pp_split_points)
    with torch.device("meta"):
        model, stage_modules = build_stage_model(config.model, stage_ids, ranges)
    if fsdp:
        mesh = runtime.device_mesh["dp_shard"]
        for stage in stage_modules:
            for block in stage.layers.values():
                fully_shard(block, mesh=mesh)
            fully_shard(stage, mesh=mesh)
    model.to_empty(device=runtime.device)
    model.init_weights(SEED)
    bundle = build_pipeline(
        stage_modules,
        stage_ids,
        runtime,
        config.distributed,
        cross_entropy_sum,
        num_microbatches=config.train.grad_accum_steps,
    )
    inputs, labels, doc_ids = _step_data(runtime.dp_size)
    scale = runtime.dp_size / (labels != IGNORE_INDEX).sum()
    steps = []
    for _ in range(2):
        x, y, docs = (t[runtime.dp_rank] for t in (inputs, labels, doc_ids))
        losses = bundle.run(x, y, scale, docs)
        grads = {}
        for name, param in model.named_parameters():
            grad = param.grad
            assert grad is not None, name
            grads[name] = grad.full_tensor() if isinstance(grad, DTensor) else grad.clone()
        model.zero_grad(set_to_none=True)
        steps.append({"losses": losses, "grads": grads})
    return {"dp_rank": runtime.dp_rank, "is_last": bundle.is_last, "steps": steps}


def _every_schedule(rank: int, world_size: int) -> dict[str, dict[str, object]]:
    """Every schedule on one spawned group: the process start-up dominates the cost."""
    return {s: _pipeline_steps(_config(s), fsdp=False) for s in SCHEDULES}


def _fsdp_1f1b(rank: int, world_size: int) -> dict[str, object]:
    return _pipeline_steps(_config("1f1b", dp_shard=2), fsdp=True)


def _assert_matches_one_process(results: list[dict], config: JobConfig, dp: int) -> None:
    """Every step of every rank: its gradients and (last stage) losses equal one process's;
    the ranks' parameters together are the whole model's, each under its own name."""
    ref_losses, ref_grads = _reference(config, dp)
    # Stages, micro-batches and rank reductions sum in other orders than one process: the
    # model's chain of sums, and the micro-batch's tokens for a loss, reordered in fp32.
    loss_terms = transformer_terms(config.model, SEQ, backward=False) + BATCH * SEQ
    grad_terms = transformer_terms(config.model, SEQ) + dp * NUM_MICRO * BATCH * SEQ
    for step in range(2):
        seen: set[str] = set()
        for result in results:
            losses, grads = result["steps"][step]["losses"], result["steps"][step]["grads"]
            assert set(grads) <= set(ref_grads)
            seen |= set(grads)
            for name, grad in grads.items():
                assert_reordered_close(grad, ref_grads[name], terms=grad_terms)
            if result["is_last"]:
                first = result["dp_rank"] * NUM_MICRO
                expected = torch.stack(ref_losses[first : first + NUM_MICRO])
                assert_reordered_close(torch.stack(losses), expected, terms=loss_terms)
            else:
                assert losses == []
        assert seen == set(ref_grads)


@pytest.fixture(scope="module")
def every_schedule() -> list[dict[str, dict[str, object]]]:
    return run_distributed(_every_schedule, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_pipeline_step_matches_one_process(every_schedule, schedule):
    results = [per_rank[schedule] for per_rank in every_schedule]
    _assert_matches_one_process(results, _config(schedule), dp=1)


@pytest.mark.distributed
def test_interleaved_ranks_hold_alternate_layers(every_schedule):
    names = [set(r["interleaved_1f1b"]["steps"][0]["grads"]) for r in every_schedule]
    layers = [sorted({n.split(".")[1] for n in rank if n.startswith("layers.")}) for rank in names]
    assert layers == [["0", "2"], ["1", "3"]]
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]


@pytest.mark.distributed
def test_v_shaped_ranks_hold_a_stage_on_the_way_down_and_one_on_the_way_back(every_schedule):
    for schedule in ("zbv", "dualpipev"):
        names = [set(r[schedule]["steps"][0]["grads"]) for r in every_schedule]
        layers = [
            sorted({n.split(".")[1] for n in rank if n.startswith("layers.")}) for rank in names
        ]
        assert layers == [["0", "3"], ["1", "2"]]
        # Rank 0 holds the first and the last stage: the embedding, the head and the loss.
        assert {"tok_embeddings.weight", "output.weight"} <= names[0]
        assert [r[schedule]["is_last"] for r in every_schedule] == [True, False]


@pytest.mark.distributed
def test_pipeline_with_fsdp_matches_one_process():
    results = run_distributed(_fsdp_1f1b, 4)
    _assert_matches_one_process(results, _config("1f1b", dp_shard=2), dp=2)


def test_even_split_gives_every_stage_the_same_layers():
    assert stage_layer_ranges(8, 4, []) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert stage_layer_ranges(4, 1, []) == [(0, 4)]


def test_remainder_layers_go_to_the_first_stages():
    assert stage_layer_ranges(10, 4, []) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert stage_layer_ranges(5, 4, []) == [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_split_points_start_the_later_stages():
    assert stage_layer_ranges(8, 3, [1, 5]) == [(0, 1), (1, 5), (5, 8)]


@pytest.mark.parametrize(
    ("n_layers", "num_stages", "points"),
    [(4, 5, []), (4, 0, []), (8, 3, [2]), (8, 3, [5, 5]), (8, 2, [8]), (8, 2, [0])],
)
def test_impossible_splits_are_refused(n_layers, num_stages, points):
    with pytest.raises(ValueError):
        stage_layer_ranges(n_layers, num_stages, points)


def test_ranks_hold_stages_in_loop_order():
    assert stages_of_rank(0, 2, 1) == [0]
    assert stages_of_rank(1, 2, 1) == [1]
    assert stages_of_rank(0, 2, 2) == [0, 2]
    assert stages_of_rank(1, 4, 3) == [1, 5, 9]
    with pytest.raises(ValueError):
        stages_of_rank(2, 2, 1)


def test_stage_model_keeps_its_layers_under_the_whole_models_names():
    config = _config("interleaved_1f1b")
    ranges = stage_layer_ranges(4, 4, [])
    with torch.device("meta"):
        whole = set(dict(Transformer(config.model).named_parameters()))
        model, stages = build_stage_model(config.model, [1, 3], ranges)
    names = set(dict(model.named_parameters()))
    assert names <= whole
    assert {n.split(".")[1] for n in names if n.startswith("layers.")} == {"1", "3"}
    assert model.tok_embeddings is None and model.output is not None
    assert [list(s.layers) for s in stages] == [["1"], ["3"]]
    assert set(dict(stages[1].named_parameters())) == {
        n for n in names if not n.startswith("layers.1.")
    }
    shared = dict(model.named_parameters())
    for stage in stages:
        for name, param in stage.named_parameters():
            assert param is shared[name]


def test_stage_modules_chained_equal_the_whole_model():
    config = _config("interleaved_1f1b")
    ranges = stage_layer_ranges(4, 4, [])
    whole = Transformer(config.model)
    whole.init_weights(SEED)
    x = torch.randint(0, VOCAB, (BATCH, SEQ))
    h = x
    for stage_id in range(4):
        model, (stage,) = build_stage_model(config.model, [stage_id], ranges)
        model.init_weights(SEED)
        h = stage(h)
    torch.testing.assert_close(h, whole(x), atol=0, rtol=0)
