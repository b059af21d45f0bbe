"""Tensor parallelism of MoE layers and latent attention on two gloo ranks: Qwen3-MoE's,
GPT-OSS's and DeepSeek-V3's blocks (tiny) train as one process on the whole batch, with
and without sequence parallelism and under activation checkpointing: objectives, gradient
norms, gradients, weights, router metrics and balancing biases; the router stays the same
on both ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from kempnerforge.distributed.expert_parallel import set_router_groups
from kempnerforge.distributed.gradients import total_grad_norm
from kempnerforge.distributed.runtime import RuntimeContext, init_runtime
from kempnerforge.distributed.tensor_parallel import apply_tp
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
    reference_model,
    token_batch,
    whole_grads,
    whole_params,
)
from tests.support.tolerance import (
    assert_layout_close,
    assert_reordered_close,
    grad_norm_terms,
    reorder_atol,
    transformer_terms,
)

pytestmark = pytest.mark.distributed

STEPS = 4
BATCH, SEQ_LEN = 4, 16
LR = 0.5
"""Plain SGD's step: each weight moves by LR times its gradient, so two runs' weights end
apart by LR times the sum of their gradients' gaps, which the gradients' bound covers.
(Adam divides a gradient by its own size: on an element whose gradient is zero by
symmetry, two summation orders' noise of opposite signs moves it by up to 2 lr.)"""
TP = ["--distributed.tp=2", "--distributed.dp_shard=1"]

_MOE = [
    *("--model.num_experts=4", "--model.moe_top_k=2", "--model.moe_expert_hidden_dim=16"),
    *("--model.moe_aux_loss_weight=0.1", "--model.moe_router_z_loss_weight=0.01"),
]
_LATENT = [
    *("--model.mla_kv_rank=16", "--model.mla_nope_head_size=8"),
    *("--model.mla_rope_head_size=8", "--model.mla_value_head_size=8"),
]
MODELS = {
    # Softmax top-2 over 4 experts, per-head query and key norms.
    "qwen3_moe": [*_MOE, "--model.qk_norm=per_head"],
    # Biased projections and sinks, a biased router, biased experts with a clamped
    # SwiGLU whose clamp binds, and a capacity limit that drops assignments.
    "gpt_oss": [
        *_MOE,
        *("--model.attention_sinks=true", "--model.attention_bias=true"),
        *("--model.moe_router_bias=true", "--model.moe_expert_bias=true"),
        *("--model.moe_activation=clamped_swiglu", "--model.moe_swiglu_limit=0.5"),
        "--model.moe_capacity_factor=1.0",
    ],
    # Latent attention with a query latent, a dense first layer, then sigmoid routing in
    # 2 groups of which 1 is kept, a shared expert and balancing-bias updates.
    "deepseek_v3": [
        *_MOE,
        *_LATENT,
        "--model.mla_q_rank=24",
        *("--model.moe_router=sigmoid", "--model.moe_num_groups=2"),
        *("--model.moe_top_groups=1", "--model.moe_routed_scaling=2.5"),
        *("--model.moe_shared_experts=1", "--model.moe_first_dense_layers=1"),
        "--model.moe_bias_update_rate=0.05",
    ],
    # Latent attention without a query latent, over dense feed-forwards.
    "latent_dense": [*_LATENT],
}
LAYOUTS = {
    "sequence_parallel": [],
    "plain": [],
    "checkpointed": ["--distributed.activation_checkpointing=full"],
}
SCENARIOS = [(m, layout) for m in MODELS for layout in LAYOUTS]


def _parallelize_plain(runtime: RuntimeContext):
    """apply_tp without sequence parallelism (a pipeline stage's), then the router groups."""

    def parallelize(model: torch.nn.Module) -> None:
        apply_tp(model, runtime.device_mesh["tp"], sequence_parallel=False)  # type: ignore[arg-type]
        set_router_groups(model, runtime)

    return parallelize


def _objective(model: torch.nn.Module, config: Any, ids: torch.Tensor, labels: torch.Tensor):
    objective = add_moe_losses(lm_loss(model(ids), labels), model, config.model)
    record_router_stats(model)
    return objective


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _placements(tensor: torch.Tensor) -> str:
    return str(tensor.placements) if isinstance(tensor, DTensor) else "plain"


def _router_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each router's weights as this rank holds them."""
    return [_local(layer.router.gate.weight).detach().clone() for layer in moe_layers(model)]


def _biases(model: torch.nn.Module) -> list[torch.Tensor]:
    """Each sigmoid router's balancing bias."""
    routers = [layer.router for layer in moe_layers(model)]
    return [r.expert_bias.clone() for r in routers if r.expert_bias is not None]


def _train(model_name: str, layout: str) -> dict[str, Any]:
    config = job_config(*MODELS[model_name], *LAYOUTS[layout], *TP)
    runtime = init_runtime(config.distributed, "cpu")
    plain = _parallelize_plain(runtime) if layout == "plain" else None
    model = build_parallel(config, runtime, parallelize=plain)
    reference = reference_model(config)
    layers = moe_layers(model)
    result: dict[str, Any] = {
        "init": whole_params(model),
        "ref_init": whole_params(reference),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "expert_shapes": [tuple(_local(layer.experts.w1).shape) for layer in layers],
        "router_placements": [_placements(layer.router.gate.weight) for layer in layers],
    }
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    rows: dict[str, list[Any]] = {"loss": [], "ref_loss": [], "norm": [], "ref_norm": []}
    rows.update(grads=[], ref_grads=[], aux=[], ref_aux=[], load=[], ref_load=[], bias=[])
    for step in range(STEPS):
        ids, labels = token_batch(100 + step, BATCH, SEQ_LEN, config.model.vocab_size)
        for m in (model, reference):
            begin_router_step(m, step)
        objective = _objective(model, config, ids, labels)
        objective.backward()
        ref_objective = _objective(reference, config, ids, labels)
        ref_objective.backward()
        rows["grads"].append(whole_grads(model))
        rows["ref_grads"].append(whole_grads(reference))
        rows["norm"].append(float(total_grad_norm(model, 0.0)))  # 0: no clipping
        rows["ref_norm"].append(float(total_grad_norm(reference, 0.0)))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        row = finish_router_step(model, config.model, None, max_steps=STEPS, with_metrics=True)
        ref_row = finish_router_step(
            reference, config.model, None, max_steps=STEPS, with_metrics=True
        )
        rows["loss"].append(objective.item())
        rows["ref_loss"].append(ref_objective.item())
        if row is not None and ref_row is not None:
            rows["aux"].append(row["moe/aux_loss"])
            rows["ref_aux"].append(ref_row["moe/aux_loss"])
            rows["load"].append(row["moe/load"])
            rows["ref_load"].append(ref_row["moe/load"])
        rows["bias"].append(_biases(model))
    result.update(rows)
    result["params"] = whole_params(model)
    result["ref_params"] = whole_params(reference)
    result["router_weights"] = _router_weights(model)
    result["biases"] = _biases(model)
    result["ref_biases"] = _biases(reference)
    with torch.no_grad():
        ids, _ = token_batch(999, BATCH, SEQ_LEN, config.model.vocab_size)
        result["eval_logits"] = model(ids)
        result["ref_eval_logits"] = reference(ids)
    return result


def _all_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    return {f"{m}-{layout}": _train(m, layout) for m, layout in SCENARIOS}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_all_scenarios, 2, timeout_s=300)


def _bound(model_name: str) -> dict[str, Any]:
    """layout_atol's sizes: the model's chain and the batch's tokens a loss averages."""
    config = job_config(*MODELS[model_name])
    return {"cfg": config.model, "seq_len": SEQ_LEN, "tokens": BATCH * SEQ_LEN}


def _gradient_terms(model_name: str, updates: int) -> int:
    """The sums along a gradient's chain (forward, backward, the tokens of its loss), and
    one such chain per earlier update, whose gradients moved the weights it is taken at."""
    config = job_config(*MODELS[model_name])
    chain = transformer_terms(config.model, SEQ_LEN) + BATCH * SEQ_LEN
    return (updates + 1) * chain


def _weight_atol(model_name: str, name: str, ref_grads: list[dict[str, torch.Tensor]]) -> float:
    """How far weight ``name`` may end from one process's after the SGD updates: LR times
    the sum of its gradients' bounds (each update's chain, the largest |gradient| for the
    terms' magnitude)."""
    return LR * sum(
        reorder_atol(
            torch.float32, _gradient_terms(model_name, update), float(grads[name].abs().max())
        )
        for update, grads in enumerate(ref_grads)
    )


@pytest.mark.parametrize(("model_name", "layout"), SCENARIOS)
def test_tensor_parallel_trains_like_one_process(two_ranks, model_name, layout):
    results = [ranks[f"{model_name}-{layout}"] for ranks in two_ranks]
    first = results[0]
    bound = _bound(model_name)
    config = job_config(*MODELS[model_name])
    for result in results:
        # Every shard is its slice of one process's draw: bitwise the same weights.
        for name, value in result["init"].items():
            assert torch.equal(value, result["ref_init"][name]), name
        assert result["all_dtensor"]  # what the foreach optimizers need
        # The ranks compute one program on the same whole tokens and reduced values.
        assert result["loss"] == first["loss"] and result["norm"] == first["norm"]
        # The routers never drift apart: weights and balancing biases bitwise equal.
        for mine, rank0 in zip(result["router_weights"], first["router_weights"], strict=True):
            assert torch.equal(mine, rank0)
        for mine, rank0 in zip(result["biases"], first["biases"], strict=True):
            assert torch.equal(mine, rank0)
    assert_layout_close(first["loss"], first["ref_loss"], **bound)
    norm_terms = grad_norm_terms(job_config(*MODELS[model_name]))
    assert_layout_close(first["norm"], first["ref_norm"], norm_terms=norm_terms, **bound)
    for update, (grads, ref_grads) in enumerate(
        zip(first["grads"], first["ref_grads"], strict=True)
    ):
        terms = _gradient_terms(model_name, update)
        for name, want in ref_grads.items():
            assert_reordered_close(grads[name], want, terms=terms)
    for name, want in first["ref_params"].items():
        gap = (first["params"][name] - want).abs().max().item()
        atol = _weight_atol(model_name, name, first["ref_grads"])
        assert gap <= atol, f"{name}: {gap:.3g} past {atol:.3g}"
    assert_reordered_close(
        first["eval_logits"], first["ref_eval_logits"], terms=_gradient_terms(model_name, STEPS)
    )
    if not config.model.is_moe:
        return
    # Every token is routed as one process routes it: the same loads, and the same
    # balancing biases, which move only by whole steps of the load's sign.
    assert first["load"] == first["ref_load"]
    for got, want in zip(first["biases"], first["ref_biases"], strict=True):
        assert torch.equal(got, want)
    assert_layout_close(first["aux"], first["ref_aux"], **bound)
    hidden = config.model.expert_hidden_dim // 2
    assert all(shape == (4, 32, hidden) for shape in first["expert_shapes"])
    assert all(p == "(Replicate(),)" for p in first["router_placements"])


def test_sigmoid_routers_move_their_balancing_biases(two_ranks):
    steps = two_ranks[0]["deepseek_v3-sequence_parallel"]["bias"]
    assert any(bool(bias.abs().sum() > 0) for biases in steps for bias in biases)
