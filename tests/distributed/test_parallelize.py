"""parallelize_model on real gloo ranks: TP, FSDP, HSDP and TP x FSDP give the single-process
model's weights, outputs and gradients; activation checkpointing and compile change nothing."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kempnerforge.distributed.activation_checkpointing import apply_ac
from kempnerforge.distributed.blocks import transformer_blocks
from kempnerforge.distributed.parallelize import ParallelPlan, apply_compile, parallelize_model
from kempnerforge.distributed.runtime import RuntimeContext, init_runtime
from kempnerforge.distributed.tensor_parallel import apply_tp
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.preflight import UNEVEN_SEQUENCE_TORCH, torch_release
from tests.support.dist import run_distributed
from tests.support.parallel import (
    build_parallel,
    job_config,
    lm_loss,
    max_diff,
    parallel_plan,
    reference_model,
    token_batch,
    whole_grads,
    whole_params,
)

EXACT = 0.0
"""Initial weights: every shard is a slice of the same full draw, so bitwise equal."""
FORWARD_TOL = 1e-5
"""Sharded matmuls sum in another order than the single-process ones: fp32 rounding."""
TRAIN_TOL = 1e-5
"""Losses and weights after a few AdamW steps on rank-split batches."""


def _step_diffs(
    model: nn.Module, reference: nn.Module, batch: tuple[torch.Tensor, ...], **kwargs: Any
) -> dict[str, float]:
    """One forward/backward of both models on the same batch: logit and gradient gaps."""
    ids, labels = batch
    logits, want = model(ids, **kwargs), reference(ids, **kwargs)
    lm_loss(logits, labels).backward()
    lm_loss(want, labels).backward()
    diffs = {
        "logits": (logits - want).abs().max().item(),
        "grads": max_diff(whole_grads(model), whole_grads(reference)),
    }
    model.zero_grad()
    reference.zero_grad()
    return diffs


# --- two ranks: one process group for every scenario ---------------------------------------
# Starting ranks costs seconds each time (import torch, join the group), so the 2-rank
# scenarios share one launch, each building its own mesh; each test checks its part.

TP = ["--distributed.tp=2", "--distributed.dp_shard=1"]
UNEVEN = (5,) if torch_release(torch.__version__) >= UNEVEN_SEQUENCE_TORCH else ()
"""A sequence two ranks cannot split evenly, under sequence parallelism where this torch
gathers it (preflight refuses such a train.seq_len on older torch)."""
TP_VARIANTS = {
    # name: (overrides, sequence lengths)
    "sequence_parallel": ([], (16, *UNEVEN)),
    "vocab_not_divisible": (["--model.vocab_size=65"], (16, *UNEVEN)),
    "tied": (["--model.tie_embeddings=true"], (16,)),
    "plain": ([], (16, 5)),
    "checkpointed": (["--distributed.activation_checkpointing=full"], (16,)),
}
FSDP = [
    "--distributed.dp_shard=2",
    "--model.tie_embeddings=true",
    "--distributed.activation_checkpointing=selective",
]
"""FSDP over 2 ranks, the tied embedding in the root unit, block 0 checkpointed."""
HSDP = [
    "--distributed.dp_replicate=2",
    "--distributed.dp_shard=1",
    "--distributed.reshard_after_forward=false",
]
"""HSDP with shard groups of 1 (two replicas); gathered weights kept after forward."""


def _two_rank_scenarios(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    runtime = init_runtime(job_config(*TP).distributed, "cpu")
    for name, (overrides, seq_lens) in TP_VARIANTS.items():
        results[f"tp_{name}"] = _tensor_parallel_diffs(runtime, name, overrides, seq_lens)
    results["tp_first_stage"] = _first_stage_diffs(runtime)
    results["tp_compile"] = _compile_with_tensor_parallel(runtime)
    results["fsdp"] = _train_both(FSDP, steps=5)
    results["hsdp"] = _train_both(HSDP, steps=5)
    results["fsdp_bf16"] = _bf16_forward()
    return results


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_two_rank_scenarios, 2)


# --- tensor parallelism ------------------------------------------------------------------


def _tensor_parallel_diffs(
    runtime: RuntimeContext, name: str, overrides: list[str], seq_lens: tuple[int, ...]
) -> dict[str, float]:
    config = job_config(*TP, *overrides)
    mesh = runtime.device_mesh["tp"]
    plain = (lambda m: apply_tp(m, mesh, sequence_parallel=False)) if name == "plain" else None
    model = build_parallel(config, runtime, parallelize=plain)
    reference = reference_model(config)
    vocab = config.model.vocab_size
    diffs = {"init": max_diff(whole_params(model), whole_params(reference))}
    for seq_len in seq_lens:
        step = _step_diffs(model, reference, token_batch(seq_len, 2, seq_len, vocab))
        diffs.update({f"{k}_{seq_len}": v for k, v in step.items()})
    doc_ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 16])
    masked = _step_diffs(model, reference, token_batch(7, 2, 16, vocab), doc_ids=doc_ids)
    diffs.update({f"{k}_masked": v for k, v in masked.items()})
    layout = {
        "tied": model.output.weight is model.tok_embeddings.weight,  # type: ignore[union-attr]
        # Sequence parallel: the embedding hands the blocks a sequence-split DTensor.
        "sequence_parallel": isinstance(
            model.tok_embeddings(torch.zeros(1, 4, dtype=torch.long)),  # type: ignore[misc]
            DTensor,
        ),
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "vocab_split": isinstance(model.tok_embeddings.weight, DTensor),  # type: ignore[union-attr]
    }
    return {**diffs, **{k: float(v) for k, v in layout.items()}}


def _first_stage_diffs(runtime: RuntimeContext) -> dict[str, float]:
    """A pipeline stage without the head gets plain TP and returns whole hidden states."""
    config = job_config(*TP)

    def first_stage(model: nn.Module) -> None:
        assert isinstance(model, Transformer)
        model.keep_layers(0, 1)
        parallelize_model(model, runtime, parallel_plan(config))

    model = build_parallel(config, runtime, parallelize=first_stage)
    reference = reference_model(config)
    reference.keep_layers(0, 1)
    ids, _ = token_batch(3, 2, 16, config.model.vocab_size)
    hidden, want = model(ids), reference(ids)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(0))
    (hidden * weights).sum().backward()
    (want * weights).sum().backward()
    return {
        "init": max_diff(whole_params(model), whole_params(reference)),
        "hidden": (hidden - want).abs().max().item(),
        "grads": max_diff(whole_grads(model), whole_grads(reference)),
        "plain_tensor": float(type(hidden) is torch.Tensor),
    }


def _compile_with_tensor_parallel(runtime: RuntimeContext) -> dict[str, Any]:
    """parallelize_model with train.compile under TP: what it compiled, what it logged."""
    handler = _Messages()
    logger = logging.getLogger("kempnerforge.distributed.parallelize")
    logger.addHandler(handler)
    try:
        config = job_config(*TP, "--train.compile=true")
        with torch.device("meta"):
            model = Transformer(config.model)
        parallelize_model(model, runtime, parallel_plan(config))
    finally:
        logger.removeHandler(handler)
    compiled = [b._compiled_call_impl is not None for _, b in transformer_blocks(model)]
    return {"compiled": compiled, "warnings": [m for m in handler.messages if "ignored" in m]}


class _Messages(logging.Handler):
    """Keeps the messages logged to it (caplog does not reach a spawned rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.distributed
def test_train_compile_is_ignored_with_a_warning_under_tensor_parallelism(two_ranks):
    for result in two_ranks:
        assert result["tp_compile"]["compiled"] == [False, False]
        assert result["tp_compile"]["warnings"] == [
            "train.compile is ignored with distributed.tp = 2: compiling tensor-parallel "
            "blocks fails in backward in this PyTorch version; the blocks run eagerly"
        ]


LAYOUTS = {
    # variant: (tied, sequence_parallel, vocab_split)
    "sequence_parallel": (0.0, 1.0, 1.0),
    "vocab_not_divisible": (0.0, 1.0, 1.0),
    "tied": (1.0, 1.0, 1.0),
    "plain": (0.0, 0.0, 1.0),
    "checkpointed": (0.0, 1.0, 1.0),
}


@pytest.mark.distributed
@pytest.mark.parametrize("variant", [*TP_VARIANTS, "first_stage"])
def test_tensor_parallel_matches_the_single_process_model(two_ranks, variant):
    diffs = dict(two_ranks[0][f"tp_{variant}"])
    assert diffs == two_ranks[1][f"tp_{variant}"]
    assert diffs.pop("init") == EXACT
    if variant == "first_stage":
        assert diffs.pop("plain_tensor") == 1.0  # a stage boundary passes plain tensors
    else:
        layout = tuple(diffs.pop(k) for k in ("tied", "sequence_parallel", "vocab_split"))
        assert layout == LAYOUTS[variant]
        assert diffs.pop("all_dtensor") == 1.0  # what the foreach optimizers need
    assert all(value < FORWARD_TOL for value in diffs.values()), diffs


# --- data parallelism: FSDP, HSDP, TP x FSDP ---------------------------------------------


def _train_both(overrides: list[str], steps: int) -> dict[str, Any]:
    """``steps`` AdamW steps of the parallel model on this rank's share of each batch and
    of the reference on the whole batch; the gaps between them."""
    config = job_config(*overrides)
    runtime = init_runtime(config.distributed, "cpu")
    model = build_parallel(config, runtime)
    reference = reference_model(config)
    wq = model.layers["0"].attention.wq.weight  # type: ignore[union-attr]
    result: dict[str, Any] = {
        "init": max_diff(whole_params(model), whole_params(reference)),
        "names": list(model.state_dict()) == list(reference.state_dict()),
        "classes": [type(b).__name__ for _, b in transformer_blocks(model)],
        "placements": str(wq.placements),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    losses, ref_losses, grad_diffs = [], [], []
    share = 4 // runtime.dp_size
    mine = slice(runtime.dp_rank * share, (runtime.dp_rank + 1) * share)
    ids, labels = token_batch(100, 4, 16, config.model.vocab_size)  # the same batch: loss falls
    for _ in range(steps):
        loss = lm_loss(model(ids[mine]), labels[mine])
        loss.backward()
        ref_loss = lm_loss(reference(ids), labels)
        ref_loss.backward()
        grad_diffs.append(max_diff(whole_grads(model), whole_grads(reference)))
        for opt in (optimizer, ref_optimizer):
            opt.step()
            opt.zero_grad()
        dp_mean = loss.detach().clone()
        dist.all_reduce(dp_mean, op=dist.ReduceOp.AVG, group=runtime.group("dp"))
        losses.append(dp_mean.item())
        ref_losses.append(ref_loss.item())
    result.update(
        tied=model.output.weight is model.tok_embeddings.weight,  # type: ignore[union-attr]
        losses=losses,
        ref_losses=ref_losses,
        grads=max(grad_diffs),
        params=max_diff(whole_params(model), whole_params(reference)),
    )
    return result


def _check_training(ranks: list[dict[str, Any]], classes: list[str], placements: str) -> None:
    for result in ranks:
        assert result["init"] == EXACT
        assert result["names"], "parameter names changed"
        assert result["classes"] == classes
        assert result["placements"] == placements
        assert result["grads"] < TRAIN_TOL, result["grads"]
        assert result["params"] < TRAIN_TOL, result["params"]
        gaps = [abs(a - b) for a, b in zip(result["losses"], result["ref_losses"], strict=True)]
        assert max(gaps) < TRAIN_TOL, gaps
    assert all(result["losses"] == ranks[0]["losses"] for result in ranks)
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


@pytest.mark.distributed
def test_fsdp_training_with_tied_embeddings_and_selective_ac_matches_one_process(two_ranks):
    classes = ["FSDPCheckpointedTransformerBlock", "FSDPTransformerBlock"]
    _check_training([r["fsdp"] for r in two_ranks], classes, "(Shard(dim=0),)")
    assert all(r["fsdp"]["tied"] for r in two_ranks)  # one parameter, trained as one


@pytest.mark.distributed
def test_hsdp_training_matches_one_process(two_ranks):
    placements = "(Replicate(), Shard(dim=0))"
    _check_training([r["hsdp"] for r in two_ranks], ["FSDPTransformerBlock"] * 2, placements)


def _bf16_forward() -> dict[str, Any]:
    """One forward under the bf16 policy: bf16 compute, fp32 sharded weights."""
    config = job_config("--distributed.dp_shard=2", "--train.mixed_precision=bf16")
    runtime = init_runtime(config.distributed, "cpu")
    model = build_parallel(config, runtime)
    ids, labels = token_batch(5, 2, 16, config.model.vocab_size)
    logits = model(ids)
    want = reference_model(config)(ids)
    lm_loss(logits, labels).backward()
    return {
        "logits_dtype": str(logits.dtype),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),  # type: ignore[union-attr]
        "loss_gap": abs(lm_loss(logits, labels).item() - lm_loss(want, labels).item()),
    }


@pytest.mark.distributed
def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_weights(two_ranks):
    for result in two_ranks:
        assert result["fsdp_bf16"]["logits_dtype"] == "torch.bfloat16"
        assert result["fsdp_bf16"]["param_dtypes"] == ["torch.float32"]
        assert result["fsdp_bf16"]["grad_dtypes"] == ["torch.float32"]
        assert result["fsdp_bf16"]["loss_gap"] < 2e-2  # bf16 rounding of a loss near 4.2


def _tensor_parallel_fsdp(rank: int, world_size: int) -> dict[str, Any]:
    return _train_both(["--distributed.tp=2", "--distributed.dp_shard=2"], steps=2)


@pytest.mark.distributed
def test_tensor_parallel_with_fsdp_on_four_ranks_matches_one_process():
    # A 2 x 2 mesh: each parameter is split over tp, then FSDP splits that shard again
    # (a _StridedShard placement), and init must still draw the single-process weights.
    ranks = run_distributed(_tensor_parallel_fsdp, 4)
    placements = "(_StridedShard(dim=0, sf=2), Shard(dim=0))"
    _check_training(ranks, ["FSDPTransformerBlock"] * 2, placements)


# --- one process: meta build, activation checkpointing, compile --------------------------


def _single_process(*overrides: str) -> tuple[Transformer, Transformer]:
    config = job_config(*overrides)
    return build_parallel(config, RuntimeContext()), reference_model(config)


def test_a_meta_built_model_initializes_to_the_single_process_weights():
    model, reference = _single_process()
    assert max_diff(whole_params(model), whole_params(reference)) == EXACT
    assert torch.equal(model.rope_cos, reference.rope_cos)


@pytest.mark.parametrize(
    ("mode", "every", "checkpointed"),
    [("full", 2, [0, 1]), ("selective", 2, [0]), ("selective", 1, [0, 1]), ("none", 2, [])],
)
def test_activation_checkpointing_recomputes_and_keeps_names_and_grads(mode, every, checkpointed):
    config = job_config(
        f"--distributed.activation_checkpointing={mode}", f"--distributed.ac_every={every}"
    )
    model = build_parallel(config, RuntimeContext())
    reference = reference_model(config)
    calls = {index: 0 for index, _ in transformer_blocks(model)}
    for index, block in transformer_blocks(model):
        # A pre-hook on the first sublayer: recomputation stops once it has rebuilt what
        # backward needs, so a hook at the end of a block may never run again.
        block.attention_norm.register_forward_pre_hook(
            lambda *_, index=index: calls.__setitem__(index, calls[index] + 1)
        )
    assert list(model.state_dict()) == list(reference.state_dict())
    diffs = _step_diffs(model, reference, token_batch(0, 2, 16, config.model.vocab_size))
    assert diffs == {"logits": 0.0, "grads": 0.0}
    # A checkpointed block ran its forward again during backward.
    assert [i for i, n in calls.items() if n == 2] == checkpointed
    assert all(n in (1, 2) for n in calls.values())


def test_activation_checkpointing_twice_wraps_once():
    model, _ = _single_process()
    apply_ac(model, "full", 1)
    apply_ac(model, "full", 1)
    assert [type(b).__mro__[1].__name__ for _, b in transformer_blocks(model)] == [
        "_Checkpointed",
        "_Checkpointed",
    ]


def test_unknown_activation_checkpointing_mode_is_refused():
    model, _ = _single_process()
    with pytest.raises(ValueError, match="'none', 'full' or 'selective', not 'some'"):
        apply_ac(model, "some", 1)


def test_compiled_blocks_keep_names_and_match_eager():
    model, reference = _single_process("--distributed.activation_checkpointing=full")
    apply_compile(model, backend="aot_eager")
    assert list(model.state_dict()) == list(reference.state_dict())
    diffs = _step_diffs(model, reference, token_batch(0, 2, 16, model.cfg.vocab_size))
    assert diffs["logits"] < 1e-6 and diffs["grads"] < 1e-6, diffs


def test_train_compile_compiles_every_block():
    config = job_config("--train.compile=true")
    with torch.device("meta"):
        model = Transformer(config.model)
    parallelize_model(model, RuntimeContext(), parallel_plan(config))
    compiled = [b._compiled_call_impl is not None for _, b in transformer_blocks(model)]
    assert compiled == [True, True]
    assert not any("_orig_mod" in name for name in model.state_dict())


def test_parallel_plan_takes_the_distributed_fields_and_the_precision_of_the_device():
    config = job_config(
        "--distributed.activation_checkpointing=selective",
        "--distributed.ac_every=3",
        "--distributed.reshard_after_forward=false",
        "--train.compile=true",
    )
    plan = ParallelPlan.of(config.distributed, config.train, "cpu")
    assert plan == ParallelPlan("selective", 3, reshard_after_forward=False, compile=True)
    assert ParallelPlan.of(config.distributed, config.train, "cuda").bf16  # 'auto' on a GPU
    forced = job_config("--train.mixed_precision=bf16")
    assert ParallelPlan.of(forced.distributed, forced.train, "cpu").bf16


def test_parallelize_model_applies_the_plan_it_is_given():
    config = job_config()
    with torch.device("meta"):
        model = Transformer(config.model)
    parallelize_model(model, RuntimeContext(), ParallelPlan(activation_checkpointing="full"))
    assert [type(b).__name__ for _, b in transformer_blocks(model)] == [
        "CheckpointedTransformerBlock"
    ] * 2
