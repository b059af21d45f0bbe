"""An MoE model split into pipeline stages on real gloo ranks trains as one process does:
losses, gradient norms, weights after a few steps, the sigmoid routers' balancing biases
and the logged per-layer loads of every stage."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor

from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import init_runtime, world_size_from_env
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from tests.support.dist import run_distributed
from tests.support.metrics_rows import train_rows
from tests.support.tiny import tiny_run
from tests.support.tolerance import (
    assert_layout_close,
    grad_norm_terms,
    reorder_atol,
    transformer_terms,
)

pytestmark = pytest.mark.distributed

STEPS = 3
SEQ_LEN, TOKENS = 32, 4 * 32
"""A window's length, and the tokens of a step's global batch (2 micro-batches of 2)."""

MOE = [
    "--model.n_layers=4",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.num_experts=4",
    "--model.moe_top_k=2",
    "--model.moe_expert_hidden_dim=16",
    "--model.moe_shared_experts=1",
    "--model.moe_router=sigmoid",
    "--model.moe_bias_update_rate=0.01",
    # Large enough that a router term left out of a stage's backward changes the weights.
    "--model.moe_aux_loss_weight=0.1",
    "--model.moe_router_z_loss_weight=0.01",
    f"--train.max_steps={STEPS}",
    "--train.deterministic=true",
    "--train.batch_size=2",
    "--train.grad_accum_steps=2",
    "--scheduler.warmup_steps=1",
    "--data.document_masking=false",
]


def _train(rank: int, world_size: int, overrides: list[str]) -> dict[str, Any]:
    """The real build and loop; return each step's loss and norm, and this rank's
    parameters and expert biases at the end, under the whole model's names."""
    config = load_config(None, overrides)
    config.validate(world_size_from_env())
    session = build_session(config, init_runtime(config.distributed, "cpu"))
    record: dict[str, Any] = {"losses": [], "grad_norms": []}
    inner = session.step_fn

    def recording(s, step):
        result = inner(s, step)
        record["losses"].append(result.loss)
        record["grad_norms"].append(result.grad_norm)
        return result

    session.step_fn = recording
    with session.tracker:
        run_training_loop(session, step=0, tokens_seen=0)
    state = {}
    for name, tensor in [*session.model.named_parameters(), *session.model.named_buffers()]:
        if name.endswith(".weight") or name.endswith("expert_bias") or "experts.w" in name:
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            state[name] = full.detach().clone()
    record["state"] = state
    return record


@pytest.fixture(scope="module")
def one_process(token_dirs, tmp_path_factory) -> tuple[dict[str, Any], Any]:
    run_dir = tmp_path_factory.mktemp("one")
    overrides = tiny_run(run_dir, token_dirs, *MOE)
    return run_distributed(_train, 1, overrides)[0], run_dir


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_1f1b"])
def test_moe_pipeline_trains_like_one_process(one_process, token_dirs, tmp_path, schedule):
    reference, ref_dir = one_process
    layout = ["--distributed.pp=2", "--distributed.dp_shard=1"]
    overrides = tiny_run(
        tmp_path, token_dirs, *MOE, *layout, f"--distributed.pp_schedule={schedule}"
    )
    ranks = run_distributed(_train, 2, overrides)
    # Stages sum in other orders than one process: layout_atol's fp32 reordering of the
    # model's chain, the batch's tokens and the updates before each step.
    config = load_config(None, overrides)
    bound = {"cfg": config.model, "seq_len": SEQ_LEN, "tokens": TOKENS}
    for record in ranks:
        assert_layout_close(record["losses"], reference["losses"], **bound)
        norms = record["grad_norms"], reference["grad_norms"]
        assert_layout_close(*norms, norm_terms=grad_norm_terms(config), **bound)
    # The stages hold the model between them, every tensor under its own name, once.
    held = [set(r["state"]) for r in ranks]
    assert not held[0] & held[1] and held[0] | held[1] == set(reference["state"])
    biases = [name for name in reference["state"] if name.endswith("expert_bias")]
    assert len(biases) == 4
    # A weight is its start, decayed, less STEPS updates of at most about lr each (Adam
    # divides out the gradient's scale); an update differs by the share its gradient's chain
    # of sums allows, and decay and update round twice a step at the weight's own scale.
    share = reorder_atol(torch.float32, transformer_terms(config.model, SEQ_LEN) + TOKENS, 1.0)
    updates = STEPS * config.optimizer.lr * share
    for record in ranks:
        for name, value in record["state"].items():
            want = reference["state"][name]
            rounding = reorder_atol(torch.float32, 2 * STEPS, 1.0) * want.double().abs()
            diff = (value.double() - want.double()).abs()
            assert bool((diff <= updates + rounding).all()), f"{name}: {diff.max():.3g}"
    for name in biases:  # the balancing rule moved every layer's bias
        assert reference["state"][name].abs().sum() > 0, name
    # Rank 0 logs every layer's load, its stage's and the other's, as one process does.
    rows, ref_rows = train_rows(tmp_path), train_rows(ref_dir)
    assert [r["moe/load"] for r in rows] == [r["moe/load"] for r in ref_rows]
    # Forward values of the routers, logged per step: bounded as a loss is.
    for key in ("moe/aux_loss", "moe/z_loss", "moe/imbalance"):
        assert_layout_close([r[key] for r in rows], [r[key] for r in ref_rows], **bound)
