"""Parallelism-test inputs and checks: tiny job configs, models built the way the trainer
builds them (meta -> parallelize -> to_empty -> init_weights), whole-tensor comparisons."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.distributed.parallelize import ParallelPlan, parallelize_model
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.transformer import Transformer
from tests.support.tiny import TINY_MODEL

SEED = 1234
"""The init seed every parallel model and its single-process reference share."""

TINY = [*TINY_MODEL, "--model.n_heads=4", "--model.vocab_size=64", "--model.max_seq_len=32"]
"""dim 32, 2 layers, 4 heads (head size 8), SwiGLU hidden size 96, vocabulary 64."""


def job_config(*overrides: str) -> JobConfig:
    """The tiny model's JobConfig with ``overrides`` (``--section.field=value``)."""
    return load_config(None, [*TINY, *overrides])


def parallel_plan(config: JobConfig) -> ParallelPlan:
    """The ParallelPlan the trainer derives from ``config`` on a CPU rank."""
    return ParallelPlan.of(config.distributed, config.train, "cpu")


def build_parallel(
    config: JobConfig,
    runtime: RuntimeContext,
    seed: int = SEED,
    parallelize: Callable[[nn.Module], None] | None = None,
) -> Transformer:
    """The model as the trainer builds it: on meta, parallelized, then materialized and
    initialized; ``parallelize`` replaces parallelize_model when given."""
    with torch.device("meta"):
        model = Transformer(config.model)
    if parallelize is None:
        parallelize_model(model, runtime, parallel_plan(config))
    else:
        parallelize(model)
    model.to_empty(device=runtime.device)
    model.init_weights(seed)
    return model


def reference_model(config: JobConfig, seed: int = SEED) -> Transformer:
    """The unsharded single-process model with the same weights."""
    model = Transformer(config.model)
    model.init_weights(seed)
    return model


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor behind a DTensor (a collective); a plain tensor as it is."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def whole_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: whole(p.detach()).clone() for name, p in model.named_parameters()}


def whole_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} has no gradient"
        grads[name] = whole(param.grad).clone()
    return grads


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over same-named tensors; the names must agree."""
    assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
    return max((got[n].float() - want[n].float()).abs().max().item() for n in want)


def token_batch(seed: int, batch: int, seq_len: int, vocab: int) -> tuple[torch.Tensor, ...]:
    """(input_ids, labels) drawn from their own generator, the same on every rank."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Plain cross-entropy on whole logits, as the trainer's loss computes it."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
