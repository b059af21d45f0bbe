"""Plain tensor parallelism, as pipeline stages run it: the collectives it issues, counted
per block, and a V-shaped pipeline rank that holds both the embedding and the head.

Collectives are counted with torch's CommDebugMode over one forward and one backward of
the tiny model on two gloo ranks, with 1 and 2 layers, so the difference is one block's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from kempnerforge.distributed.parallelize import parallelize_model
from kempnerforge.distributed.pipeline_parallel import (
    build_stage_model,
    stage_layer_ranges,
    stages_of_rank,
)
from kempnerforge.distributed.runtime import RuntimeContext, init_runtime
from kempnerforge.distributed.tensor_parallel import apply_tp
from tests.support.dist import run_distributed
from tests.support.parallel import (
    SEED,
    build_parallel,
    job_config,
    lm_loss,
    max_diff,
    parallel_plan,
    reference_model,
    token_batch,
    whole_grads,
)

TP = ["--distributed.tp=2", "--distributed.dp_shard=1"]
LAYERS = (1, 2)


def _counts(mode: CommDebugMode) -> dict[str, int]:
    """Collective name (without its namespace) -> calls."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def _count_collectives(runtime: RuntimeContext) -> dict[Any, Any]:
    results: dict[Any, Any] = {}
    mesh = runtime.device_mesh["tp"]
    for sequence_parallel in (False, True):
        for n_layers in LAYERS:
            config = job_config(*TP, f"--model.n_layers={n_layers}")
            model = build_parallel(
                config,
                runtime,
                parallelize=lambda m, sp=sequence_parallel: apply_tp(m, mesh, sequence_parallel=sp),
            )
            ids, labels = token_batch(1, 2, 16, config.model.vocab_size)
            with CommDebugMode() as forward:
                loss = lm_loss(model(ids), labels)
            with CommDebugMode() as backward:
                loss.backward()
            key = ("sequence_parallel" if sequence_parallel else "plain", n_layers)
            results[key] = {"forward": _counts(forward), "backward": _counts(backward)}
    return results


def _v_rank_zero(runtime: RuntimeContext) -> dict[str, Any]:
    """Pipeline rank 0 of a V-shaped schedule over 2 ranks (stages 0 and 3 of 4 layers),
    tensor parallel over 2: each stage against the same layers of one process."""
    config = job_config(*TP, "--model.n_layers=4")
    stage_ids = stages_of_rank(0, 2, 2, v_shaped=True)
    with torch.device("meta"):
        model, stages = build_stage_model(config.model, stage_ids, stage_layer_ranges(4, 4, []))
    parallelize_model(model, runtime, parallel_plan(config), roots=list(stages))
    model.to_empty(device=runtime.device)
    model.init_weights(SEED)
    reference = reference_model(config)
    ids, labels = token_batch(5, 2, 16, config.model.vocab_size)
    cos, sin = reference.rope(16)
    first, want_first = stages[0](ids), reference.layers["0"](reference.embed(ids), cos, sin)
    hidden = torch.randn(want_first.shape, generator=torch.Generator().manual_seed(1))
    logits = stages[1](hidden)
    want_logits = reference.output(reference.norm(reference.layers["3"](hidden, cos, sin)))
    weights = torch.randn(first.shape, generator=torch.Generator().manual_seed(2))
    ((first * weights).sum() + lm_loss(logits, labels)).backward()
    ((want_first * weights).sum() + lm_loss(want_logits, labels)).backward()
    names = set(dict(model.named_parameters()))
    kept = {n: p.grad for n, p in reference.named_parameters() if n in names}
    return {
        "plain_tensors": type(first) is torch.Tensor and type(logits) is torch.Tensor,
        "hidden": (first - want_first).abs().max().item(),
        "logits": (logits - want_logits).abs().max().item(),
        "grads": max_diff(whole_grads(model), kept),
    }


def _plain_tp(rank: int, world_size: int) -> dict[str, Any]:
    runtime = init_runtime(job_config(*TP).distributed, "cpu")
    return {"counts": _count_collectives(runtime), "v_rank_zero": _v_rank_zero(runtime)}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_plain_tp, 2)


@pytest.fixture(scope="module")
def counts(ranks) -> list[dict[str, Any]]:
    return [rank["counts"] for rank in ranks]


@pytest.mark.distributed
def test_a_v_shaped_rank_holding_both_ends_gets_plain_tensor_parallelism(ranks):
    """Stages pass plain tensors between ranks even where one rank holds the embedding
    and the head (sequence parallelism would hand the next rank a DTensor)."""
    for rank in ranks:
        got = dict(rank["v_rank_zero"])
        assert got.pop("plain_tensors") is True
        assert all(value < 1e-5 for value in got.values()), got


@pytest.mark.distributed
def test_plain_tensor_parallel_reduces_twice_per_block_in_backward(counts):
    """One all-reduce per sublayer's input gradient, shared by its column-wise projections,
    plus one for the head's input; the norms need none (their inputs are replicated)."""
    for rank in counts:
        for n_layers in LAYERS:
            got = rank[("plain", n_layers)]
            assert got["backward"] == {"all_reduce": 2 * n_layers + 1}, (n_layers, got)
            # Forward: the embedding's reduction and one after each row-wise projection;
            # the head gathers the vocabulary-split logits.
            assert got["forward"] == {"all_reduce": 2 * n_layers + 1, "all_gather_into_tensor": 1}


@pytest.mark.distributed
def test_sequence_parallel_keeps_one_gather_and_one_scatter_per_sublayer(counts):
    for rank in counts:
        for n_layers in LAYERS:
            got = rank[("sequence_parallel", n_layers)]
            sublayers = 2 * n_layers + 1  # the head's input is gathered like a sublayer's
            assert got["backward"] == {
                "all_gather_into_tensor": sublayers,
                "reduce_scatter_tensor": sublayers,
            }, (n_layers, got)
            assert got["forward"] == {
                "all_gather_into_tensor": sublayers + 1,  # and the logits
                "reduce_scatter_tensor": sublayers,
            }, (n_layers, got)
