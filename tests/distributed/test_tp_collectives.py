"""Tensor parallelism communicates what the Megatron layout needs: counted per block.

Collectives are counted with torch's CommDebugMode over one forward and one backward of
the tiny model on two gloo ranks, with 1 and 2 layers, so the difference is one block's.
"""

from __future__ import annotations

from typing import Any

import pytest
from torch.distributed.tensor.debug import CommDebugMode

from kempnerforge.distributed.parallelize import apply_tp
from kempnerforge.distributed.runtime import init_runtime
from tests.support.dist import run_distributed
from tests.support.parallel import build_parallel, job_config, lm_loss, token_batch

TP = ["--distributed.tp=2", "--distributed.dp_shard=1"]
LAYERS = (1, 2)


def _counts(mode: CommDebugMode) -> dict[str, int]:
    """Collective name (without its namespace) -> calls."""
    return {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}


def _count_collectives(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    runtime = init_runtime(job_config(*TP).distributed, "cpu")
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


@pytest.fixture(scope="module")
def counts() -> list[dict[str, Any]]:
    return run_distributed(_count_collectives, 2)


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
