"""Muon as the trainer builds it (build_optimizer over a model parallelized by
parallelize_model) under FSDP, HSDP, tensor parallelism alone, context parallelism (FSDP
over the cp ranks) and FSDP with tensor parallelism: given the same gradients, every
weight and momentum buffer stays within the roundings of one process's Muon step on the
whole model (muon_atol on the Muon side, adamw_atol on the AdamW side: the shards'
elementwise kernels may round otherwise than the whole tensors', on another CPU if not on
this one)."""

from __future__ import annotations

import math
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
from tests.support.tolerance import adamw_atol, muon_atol

pytestmark = pytest.mark.distributed

STEPS = 3
MUON = ["--optimizer.name=muon", "--optimizer.weight_decay=0.1", "--optimizer.lr=0.02"]
LAYOUTS = {
    # name: (overrides, ranks, owners: the ranks one matrix's shards are spread over)
    # FSDP over 2 ranks: the muon side's rows (32 and 96) split evenly, the AdamW side's
    # 64-row embedding too.
    "fsdp": (["--distributed.dp_shard=2"], 2, 2),
    # HSDP with shard groups of one: each replica orthogonalises all of its own.
    "hsdp_replicas": (["--distributed.dp_replicate=2", "--distributed.dp_shard=1"], 2, 1),
    # HSDP 2 x 2: two replicas, each sharding over its own pair of ranks.
    "hsdp": (["--distributed.dp_replicate=2", "--distributed.dp_shard=2"], 4, 2),
    # Tensor parallelism alone: wq/wk/wv/w1/w3 split by rows, wo/w2 by columns (Shard(1)),
    # so the exchange cuts and joins both dimensions.
    "tp": (["--distributed.tp=2", "--distributed.dp_shard=1"], 2, 2),
    # Context parallelism alone: FSDP shards over the cp ranks (the dp_shard_cp mesh).
    "cp": (["--distributed.cp=2", "--distributed.dp_shard=1"], 2, 2),
    # FSDP over tensor parallelism: each matrix cut on both mesh dimensions (the column
    # shards' rows as _StridedShard), exchanged over the four ranks of dp_shard x tp.
    "fsdp_tp": (["--distributed.dp_shard=2", "--distributed.tp=2"], 4, 4),
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
    start = whole_params(reference)
    history: dict[str, list[torch.Tensor]] = {name: [] for name in start}
    for _ in range(STEPS):
        lm_loss(model(ids[mine]), labels[mine]).backward()
        grads = whole_grads(model)
        for name, g in grads.items():
            history[name].append(g)
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
    params_bound, buffers_bound = _bounds(reference, ref_optimizer, start, history)
    return {
        "init": init,
        "params": _share_of_bound(whole_params(model), whole_params(reference), params_bound),
        "buffers": _share_of_bound(
            _buffers(model, optimizer), _buffers(reference, ref_optimizer), buffers_bound
        ),
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


def _bounds(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    start: dict[str, torch.Tensor],
    grads: dict[str, list[torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per parameter name, from its starting weight and whole gradients: how far the
    sharded run's weight may end from the reference's (muon_atol on Muon groups, adamw_atol
    on the others), and the momentum buffer's (Muon groups)."""
    params_bound, buffers_bound = {}, {}
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    for name, p in model.named_parameters():
        group = group_of[id(p)]
        if group["use_muon"]:
            params_bound[name], buffers_bound[name] = muon_atol(
                start[name],
                grads[name],
                lr=group["lr"],
                momentum=group["momentum"],
                weight_decay=group["weight_decay"],
                ns_steps=group["ns_steps"],
            )
        else:
            params_bound[name] = adamw_atol(
                start[name],
                grads[name],
                lr=group["lr"],
                betas=group["betas"],
                eps=group["eps"],
                weight_decay=group["weight_decay"],
            )
    return params_bound, buffers_bound


def _share_of_bound(
    got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: dict[str, torch.Tensor]
) -> float:
    """The largest |got - want| / bound over every element of same-named tensors."""
    assert got.keys() == want.keys() == bound.keys(), sorted(set(got) ^ set(bound))
    return max(((got[n].double() - want[n].double()).abs() / bound[n]).max().item() for n in want)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def ranks(request) -> tuple[str, list[dict[str, Any]]]:
    _, world_size, _ = LAYOUTS[request.param]
    return request.param, run_distributed(_muon_against_one_process, world_size, request.param)


def test_muon_under_data_parallel_sharding_steps_like_one_process(ranks):
    """The starting weights are copies, equal exactly; after STEPS steps every weight and
    buffer is within its bound (a share of at most 1). A skipped momentum or a shard
    handed to the wrong owner moves a weight by a share of lr, far past the bounds."""
    _, results = ranks
    for result in results:
        assert result["dtensors"]
        assert result["init"] == 0.0
        assert result["params"] <= 1.0, f"weights differ by {result['params']:.3g} of the bound"
        assert result["buffers"] <= 1.0, f"buffers differ by {result['buffers']:.3g} of the bound"


def test_each_matrix_is_orthogonalised_once_per_shard_group(ranks):
    """Each shard group's ranks split its matrices between them, at most ceil(MATRICES /
    owners) each; replicas each do their own, so every group runs each matrix once."""
    layout, results = ranks
    owners = LAYOUTS[layout][2]
    assert [r["matrices"] for r in results] == [MATRICES] * len(results)
    calls = [r["calls"] for r in results]
    assert max(calls) <= math.ceil(MATRICES / owners) * STEPS
    assert sum(calls) == MATRICES * STEPS * len(results) // owners
