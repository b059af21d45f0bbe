"""Muon as the trainer builds it (build_optimizer over a model parallelized by
parallelize_model) under FSDP and HSDP: given the same gradients, every weight and
momentum buffer equals one process's Muon step on the whole model, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.optim import muon
from kempnerforge.optim.optimizer import build_optimizer
from tests.support.dist import run_distributed
from tests.support.parallel import (
    build_parallel,
    job_config,
    lm_loss,
    max_diff,
    reference_model,
    token_batch,
    whole,
    whole_grads,
    whole_params,
)

pytestmark = pytest.mark.distributed

STEPS = 3
MUON = ["--optimizer.name=muon", "--optimizer.weight_decay=0.1", "--optimizer.lr=0.02"]
LAYOUTS = {
    # name: (overrides, ranks)
    # FSDP over 2 ranks: the muon side's rows (32 and 96) split evenly, the AdamW side's
    # 64-row embedding too.
    "fsdp": (["--distributed.dp_shard=2"], 2),
    # HSDP with shard groups of one: each replica orthogonalises all of its own.
    "hsdp_replicas": (["--distributed.dp_replicate=2", "--distributed.dp_shard=1"], 2),
    # HSDP 2 x 2: two replicas, each sharding over its own pair of ranks.
    "hsdp": (["--distributed.dp_replicate=2", "--distributed.dp_shard=2"], 4),
}
MATRICES = 14
"""The Muon side of the tiny model: wq, wk, wv, wo, w1, w2, w3 of its two blocks."""


def _muon_against_one_process(rank: int, world_size: int, layout: str) -> dict[str, Any]:
    """STEPS steps of the parallel model's Muon and the reference's, the reference given
    the parallel model's whole gradients each step: the gaps, and the NS calls here."""
    config = job_config(*LAYOUTS[layout][0], *MUON)
    runtime = init_runtime(config.distributed, "cpu")
    model = build_parallel(config, runtime)
    reference = reference_model(config)
    optimizer = build_optimizer(model, config.optimizer)
    ref_optimizer = build_optimizer(reference, config.optimizer)
    share = 4 // runtime.dp_size
    mine = slice(runtime.dp_rank * share, (runtime.dp_rank + 1) * share)
    ids, labels = token_batch(100, 4, 16, config.model.vocab_size)
    calls = 0
    plain = muon.newton_schulz_orthogonalize

    def counted(matrix: torch.Tensor, steps: int, eps: float = 1e-7) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return plain(matrix, steps, eps)

    init = max_diff(whole_params(model), whole_params(reference))
    for _ in range(STEPS):
        lm_loss(model(ids[mine]), labels[mine]).backward()
        grads = whole_grads(model)
        for name, p in reference.named_parameters():
            p.grad = grads[name].clone()
        muon.newton_schulz_orthogonalize = counted
        try:
            optimizer.step()
        finally:
            muon.newton_schulz_orthogonalize = plain
        ref_optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
    muon_group = optimizer.param_groups[0]
    assert muon_group["use_muon"]
    return {
        "init": init,
        "params": max_diff(whole_params(model), whole_params(reference)),
        "buffers": max_diff(_buffers(model, optimizer), _buffers(reference, ref_optimizer)),
        "dtensors": all(isinstance(p, DTensor) for p in muon_group["params"]),
        "matrices": len(muon_group["params"]),
        "calls": calls,
    }


def _buffers(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Each Muon matrix's whole momentum buffer, by parameter name."""
    return {
        name: whole(optimizer.state[p]["momentum_buffer"])
        for name, p in model.named_parameters()
        if "momentum_buffer" in optimizer.state[p]
    }


@pytest.fixture(scope="module", params=list(LAYOUTS))
def ranks(request) -> tuple[str, list[dict[str, Any]]]:
    _, world_size = LAYOUTS[request.param]
    return request.param, run_distributed(_muon_against_one_process, world_size, request.param)


def test_muon_under_data_parallel_sharding_steps_like_one_process(ranks):
    _, results = ranks
    for result in results:
        assert result["dtensors"]
        assert (result["init"], result["params"], result["buffers"]) == (0.0, 0.0, 0.0)


def test_each_matrix_is_orthogonalised_once_per_shard_group(ranks):
    """Each shard group's ranks split its matrices between them; replicas each do their
    own, so a rank runs MATRICES / dp_shard Newton-Schulz calls a step."""
    layout, results = ranks
    dp_shard = 1 if layout == "hsdp_replicas" else 2
    assert [r["matrices"] for r in results] == [MATRICES] * len(results)
    assert [r["calls"] for r in results] == [MATRICES // dp_shard * STEPS] * len(results)
