"""Each published family's block on the training paths that are not layouts: activation
checkpointing gives the gradients of the plain model bitwise; compiled blocks (dynamo and
AOT autograd, the 'aot_eager' backend: the graphs inductor would take, run by torch's own
kernels) compute the plain model's loss and gradients; Muon trains every family's weights.
The layouts are tests/e2e/test_check_parallel_families.py's; inductor's kernels run in
the GPU suite (bench/gpu/, its 'families' part)."""

from __future__ import annotations

import copy

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.distributed.activation_checkpointing import apply_ac
from kempnerforge.distributed.parallelize import apply_compile
from kempnerforge.model.transformer import Transformer
from kempnerforge.optim.optimizer import build_optimizer
from tests.support.family_options import FAMILY_OPTIONS
from tests.support.tolerance import assert_reordered_close, transformer_terms

SHAPE = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4"]
SEQ, ROWS = 32, 2


def family_model(family: str) -> Transformer:
    options = FAMILY_OPTIONS[family]
    config = load_config(options.config, [*SHAPE, "--model.n_kv_heads=4", *options.args])
    model = Transformer(config.model)
    model.init_weights(seed=11)
    return model


def batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], ids[:, 1:]


def loss_and_grads(model: Transformer) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The cross-entropy of the fixed batch and each parameter's gradient, taken off the
    model."""
    loss = backward(model)
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss, grads


def backward(model: Transformer) -> torch.Tensor:
    """The cross-entropy of the fixed batch, its gradients left on the parameters."""
    ids, labels = batch(model.cfg.vocab_size)
    logits = model(ids)
    assert isinstance(logits, torch.Tensor)
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    loss.backward()
    return loss.detach()


def plain_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gradients by parameter name without the wrappers' path parts."""
    wrappers = ("_orig_mod.", "_checkpoint_wrapped_module.")
    out = {}
    for name, grad in grads.items():
        for part in wrappers:
            name = name.replace(part, "")
        out[name] = grad
    return out


@pytest.mark.parametrize("family", list(FAMILY_OPTIONS))
def test_activation_checkpointing_gives_the_plain_gradients_bitwise(family):
    model = family_model(family)
    checkpointed = copy.deepcopy(model)
    apply_ac(checkpointed, "full", 1)
    want_loss, want = loss_and_grads(model)
    got_loss, got = loss_and_grads(checkpointed)
    got = plain_names(got)
    assert torch.equal(got_loss, want_loss)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


@pytest.mark.parametrize("family", list(FAMILY_OPTIONS))
def test_compiled_blocks_compute_the_plain_loss_and_gradients(family):
    model = family_model(family)
    compiled = copy.deepcopy(model)
    apply_compile(compiled, backend="aot_eager")
    want_loss, want = loss_and_grads(model)
    got_loss, got = loss_and_grads(compiled)
    got = plain_names(got)
    terms = transformer_terms(model.cfg, SEQ)
    assert_reordered_close(got_loss, want_loss, terms=terms)
    assert got.keys() == want.keys()
    for name, grad in want.items():
        assert_reordered_close(got[name], grad, terms=terms)


@pytest.mark.parametrize("family", list(FAMILY_OPTIONS))
def test_muon_trains_every_weight_of_the_family(family):
    model = family_model(family)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = build_optimizer(model, OptimizerConfig(name="muon", lr=0.02, muon_adam_lr=3e-3))
    losses = []
    for _ in range(4):
        loss = backward(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
        # Every weight of every family gets a gradient from this batch's loss.
        assert not torch.equal(param.detach(), before[name]), f"{name} never moved"
