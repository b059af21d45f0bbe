"""Expert parallelism on real gloo ranks: an MoE model with its experts split over two
ranks (ep = 2) trains exactly as with every expert on each rank (ep = 1) and as one
process on the whole batch: outputs, router losses, gradients, weights, balancing biases
and the clipped gradient norm."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kempnerforge.distributed.gradients import total_grad_norm
from kempnerforge.distributed.runtime import init_runtime
from kempnerforge.model.moe.layer import moe_layers
from kempnerforge.model.moe.router_step import (
    begin_router_step,
    finish_router_step,
    record_router_stats,
)
from kempnerforge.training.loop import add_moe_losses
from tests.support.dist import run_distributed
from tests.support.parallel import (
    build_parallel,
    job_config,
    lm_loss,
    max_diff,
    reference_model,
    token_batch,
    whole_grads,
    whole_params,
)

TOL = 2e-5
"""Sharded and exchanged matmuls sum in another order than one process: fp32 rounding."""
STEPS = 4

MOE = [
    "--model.num_experts=4",
    "--model.moe_top_k=2",
    "--model.moe_expert_hidden_dim=16",
    "--model.moe_shared_experts=1",
    "--model.moe_aux_loss_weight=0.1",
    "--model.moe_router_z_loss_weight=0.01",
]
ROUTERS = {
    "softmax": ["--model.moe_router=softmax"],
    "sigmoid": ["--model.moe_router=sigmoid", "--model.moe_bias_update_rate=0.05"],
    "capacity": ["--model.moe_router=softmax", "--model.moe_capacity_factor=1.0"],
}
LAYOUTS = {
    "ep2": ["--distributed.dp_shard=2", "--distributed.ep=2"],
    "ep1": ["--distributed.dp_shard=2", "--distributed.ep=1"],
    # Recomputed blocks run the router's all-reduce and the token exchange again in
    # backward, on every rank alike.
    "ep2-ac": [
        "--distributed.dp_shard=2",
        "--distributed.ep=2",
        "--distributed.activation_checkpointing=full",
    ],
}
HSDP_EP = ["--distributed.dp_replicate=2", "--distributed.dp_shard=2", "--distributed.ep=2"]
"""4 ranks: two replicas, each splitting the experts over its 2 shard ranks."""


def _objective(model: torch.nn.Module, config: Any, ids: torch.Tensor, labels: torch.Tensor):
    loss = lm_loss(model(ids), labels)
    objective = add_moe_losses(loss, model, config.model)
    record_router_stats(model)
    return loss, objective


def _biases(model: torch.nn.Module) -> list[torch.Tensor]:
    return [
        layer.router.expert_bias.clone()
        for layer in moe_layers(model)
        if layer.router.expert_bias is not None
    ]


def _train(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    config = job_config(*MOE, *overrides)
    runtime = init_runtime(config.distributed, "cpu")
    model = build_parallel(config, runtime)
    reference = reference_model(config)
    experts = moe_layers(model)[0].experts
    result: dict[str, Any] = {
        "init": max_diff(whole_params(model), whole_params(reference)),
        "expert_placements": str(experts.w1.placements),
        "expert_local_shape": tuple(
            (experts.w1.to_local() if isinstance(experts.w1, DTensor) else experts.w1).shape
        ),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    share = 4 // runtime.dp_size  # 4 sequences a step, split over the data-parallel ranks
    mine = slice(runtime.dp_rank * share, (runtime.dp_rank + 1) * share)
    gaps: dict[str, list[float]] = {"loss": [], "grads": [], "norm": [], "bias": []}
    losses = []
    moved = False
    for step in range(STEPS):
        ids, labels = token_batch(100 + step, 4, 16, config.model.vocab_size)
        for m in (model, reference):
            begin_router_step(m, step)
        loss, objective = _objective(model, config, ids[mine], labels[mine])
        objective.backward()
        ref_loss, ref_objective = _objective(reference, config, ids, labels)
        ref_objective.backward()
        gaps["grads"].append(max_diff(whole_grads(model), whole_grads(reference)))
        norm = total_grad_norm(model, 1.0)
        gaps["norm"].append(abs(float(norm) - float(total_grad_norm(reference, 1.0))))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        row = finish_router_step(
            model, config.model, runtime.group("dp"), max_steps=STEPS, with_metrics=True
        )
        ref_row = finish_router_step(
            reference, config.model, None, max_steps=STEPS, with_metrics=True
        )
        assert row is not None and ref_row is not None
        gaps["bias"].append(
            max(
                [
                    (a - b).abs().max().item()
                    for a, b in zip(_biases(model), _biases(reference), strict=True)
                ]
                or [0.0]
            )
        )
        moved = moved or any(bool(b.abs().sum() > 0) for b in _biases(model))
        gaps.setdefault("aux", []).append(abs(row["moe/aux_loss"] - ref_row["moe/aux_loss"]))
        gaps.setdefault("load", []).append(float(row["moe/load"] != ref_row["moe/load"]))
        mean = objective.detach().clone()
        dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=runtime.group("dp"))
        gaps["loss"].append(abs(mean.item() - ref_objective.item()))
        losses.append(loss.item())
    result["gaps"] = {name: max(values) for name, values in gaps.items()}
    result["params"] = max_diff(whole_params(model), whole_params(reference))
    result["losses"] = losses
    result["final"] = whole_params(model)
    result["bias_moved"] = moved
    with torch.no_grad():
        ids, _ = token_batch(999, 4, 16, config.model.vocab_size)
        result["eval_logits"] = (model(ids[mine]) - reference(ids)[mine]).abs().max().item()
    return result


def _all_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    results = {}
    for router, router_args in ROUTERS.items():
        for layout, layout_args in LAYOUTS.items():
            results[f"{router}-{layout}"] = _train(rank, world_size, router_args + layout_args)
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_all_scenarios, 2, timeout_s=300)


@pytest.mark.distributed
@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_moe_layouts_train_like_one_process(two_ranks, router, layout):
    for rank, ranks in enumerate(two_ranks):
        result = ranks[f"{router}-{layout}"]
        assert result["init"] == 0.0
        assert all(gap < TOL for gap in result["gaps"].values()), result["gaps"]
        assert result["params"] < TOL
        assert result["eval_logits"] < TOL
        if router == "sigmoid":
            assert result["bias_moved"]
        if layout.startswith("ep2"):
            # Each rank stores and computes its own half of the experts.
            assert result["expert_local_shape"][0] == 2, result
            assert "Shard(dim=0)" in result["expert_placements"]
        else:
            assert result["expert_local_shape"][0] in (2, 4)  # FSDP rows, not experts
        del rank


def _hsdp_scenario(rank: int, world_size: int) -> dict[str, Any]:
    return _train(rank, world_size, ROUTERS["sigmoid"] + HSDP_EP)


@pytest.mark.distributed
def test_experts_split_within_hsdp_replicas_train_like_one_process():
    for result in run_distributed(_hsdp_scenario, 4, timeout_s=300):
        assert result["init"] == 0.0
        assert all(gap < TOL for gap in result["gaps"].values()), result["gaps"]
        assert result["params"] < TOL and result["eval_logits"] < TOL
        assert result["expert_local_shape"][0] == 2 and result["bias_moved"]


@pytest.mark.distributed
def test_capacity_dropping_is_the_same_with_experts_split_over_ranks(two_ranks):
    """Capacity is per rank's micro-batch, so a split batch drops other tokens than one
    process on the whole batch would; but where the experts live changes nothing."""
    for ranks in two_ranks:
        split, whole_experts = ranks["capacity-ep2"], ranks["capacity-ep1"]
        gaps = [abs(a - b) for a, b in zip(split["losses"], whole_experts["losses"], strict=True)]
        assert max(gaps) < TOL, gaps
        assert max_diff(split["final"], whole_experts["final"]) < TOL
