"""The fused output head + cross-entropy: equal to the whole-logits loss, without its logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.data.dataset import IGNORE_INDEX as DATA_IGNORE_INDEX
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model import build_model
from kempnerforge.model.heads.head_loss import (
    IGNORE_INDEX,
    HeadLoss,
    HeadLossSpec,
    linear_cross_entropy,
)
from kempnerforge.training.build import build_session
from kempnerforge.training.eval import evaluate
from kempnerforge.training.loop import text_step
from kempnerforge.training.loss import build_loss_fn, token_losses
from tests.support.tolerance import assert_reordered_close, reorder_atol, transformer_terms

B, S, D, V = 2, 7, 8, 50
N = B * S  # 14 tokens; N * V is no other tensor's size (V * D = 400, N * D = 112)
# Chunked and whole-logits paths sum in different orders. The loss's chain: a logit sums D
# products, its logsumexp V terms, the loss N tokens; the gradients add the logits'
# gradient summed over V (into hidden) or N (into the weight).
LOSS_TERMS = D + V + N
GRAD_TERMS = LOSS_TERMS + V + N
# bf16 rounds each logit (or, with bf16 inputs, each product's result) once, to 2**-8 of
# it, differently in each path; a token's loss moves by at most twice that logit error and
# the gradients by a few such roundings: 2e-2 is five of them, while a dropped chunk of 3
# or 4 of the 14 tokens moves the loss by a fifth or more.
BF16 = {"rtol": 2e-2, "atol": 2e-2}


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, D, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(V, D, generator=generator) / D**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=generator)
    labels[0, :4] = IGNORE_INDEX  # with chunk 3 or 4, a whole chunk is ignored
    labels[1, -1] = IGNORE_INDEX
    return hidden, weight, labels


def _plain(hidden, weight, labels, z_loss_weight):
    """The reference: whole logits through the training loss and token_losses."""
    logits = F.linear(hidden, weight)
    loss = build_loss_fn(TrainConfig(z_loss_weight=z_loss_weight))(logits, labels)
    return loss, token_losses(logits.detach(), labels, z_loss_weight)


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


def test_ignore_index_equals_the_data_layers():
    assert IGNORE_INDEX == DATA_IGNORE_INDEX


def test_default_chunk_equals_the_config_default():
    assert HeadLossSpec().chunk_tokens == TrainConfig().loss_chunk_tokens


def test_a_negative_chunk_size_names_the_field():
    with pytest.raises(ConfigError, match="train.loss_chunk_tokens"):
        TrainConfig(loss_chunk_tokens=-1)


@pytest.mark.parametrize("z_loss_weight", [0.0, 0.05])
@pytest.mark.parametrize("chunk_tokens", [1, 3, 4, 7, N, N + 5, 0])
def test_loss_and_gradients_equal_the_whole_logits_path(chunk_tokens, z_loss_weight):
    hidden, weight, labels = _inputs()
    got = linear_cross_entropy(
        hidden, weight, labels, chunk_tokens=chunk_tokens, z_loss_weight=z_loss_weight
    )
    want, want_tokens = _plain(hidden, weight, labels, z_loss_weight)
    assert_reordered_close(got.loss_sum, want, terms=LOSS_TERMS)
    assert_reordered_close(got.token_losses, want_tokens, terms=LOSS_TERMS)
    # A scale on the loss (the step's 1 / tokens) reaches both gradients.
    got_grads = _grads(got.loss_sum * 0.3, hidden, weight)
    for a, b in zip(got_grads, _grads(want * 0.3, hidden, weight), strict=True):
        assert_reordered_close(a, b, terms=GRAD_TERMS)


def test_token_losses_are_detached_and_zero_where_ignored():
    hidden, weight, labels = _inputs()
    got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=3, z_loss_weight=0.1)
    assert isinstance(got, HeadLoss)
    assert got.loss_sum.dim() == 0 and got.loss_sum.requires_grad
    assert got.token_losses.shape == labels.shape and not got.token_losses.requires_grad
    ignored = labels == IGNORE_INDEX
    assert torch.all(got.token_losses[ignored] == 0)
    assert torch.all(got.token_losses[~ignored] > 0)
    # The same N positive token losses, summed per chunk or all at once.
    assert_reordered_close(got.token_losses.sum(), got.loss_sum.detach(), terms=N)


def test_no_grad_gives_the_same_values_and_no_graph():
    """Without gradients the head runs on the scored positions only: an ignored position's
    loss is exactly 0, and a scored one's moves at most as its logits can when the matmul
    takes other rows beside it (D terms each), its loss twice that plus the z-loss's
    2 * weight * logsumexp times it."""
    hidden, weight, labels = _inputs()
    with_grad = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, z_loss_weight=0.1)
    with torch.no_grad():
        got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, z_loss_weight=0.1)
    assert not got.loss_sum.requires_grad and got.loss_sum.grad_fn is None
    assert hidden.grad is None and weight.grad is None
    ignored = labels == IGNORE_INDEX
    assert torch.all(got.token_losses[ignored] == 0)
    logits = F.linear(hidden, weight).detach()
    logit_error = reorder_atol(torch.float32, D, 1.0) * (
        hidden.detach().abs().double() @ weight.detach().abs().double().t()
    ).amax(dim=-1)
    lse = torch.logsumexp(logits.double(), dim=-1).abs()
    bound = (2 + 2 * 0.1 * lse) * logit_error + reorder_atol(torch.float32, V, 1.0) * lse
    diff = (got.token_losses.double() - with_grad.token_losses.double()).abs()
    assert torch.all(diff[~ignored] <= bound[~ignored])
    assert_reordered_close(got.token_losses.sum(), got.loss_sum, terms=N)


def test_only_the_inputs_that_need_a_gradient_get_one():
    hidden, weight, labels = _inputs()
    frozen = weight.detach()
    got = linear_cross_entropy(hidden, frozen, labels, chunk_tokens=4, z_loss_weight=0.0)
    want, _ = _plain(hidden, frozen, labels, 0.0)
    (grad,) = _grads(got.loss_sum, hidden)
    assert_reordered_close(grad, _grads(want, hidden)[0], terms=GRAD_TERMS)


def test_a_retained_graph_gives_the_same_gradients_twice():
    hidden, weight, labels = _inputs()
    got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, z_loss_weight=0.0)
    first = torch.autograd.grad(got.loss_sum, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(got.loss_sum, (hidden, weight))
    # Exact: the same backward over the same saved tensors.
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize("z_loss_weight", [0.0, 0.05])
def test_bf16_autocast_matches_the_whole_logits_path(z_loss_weight):
    hidden, weight, labels = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(
            hidden, weight, labels, chunk_tokens=4, z_loss_weight=z_loss_weight
        )
        want, want_tokens = _plain(hidden, weight, labels, z_loss_weight)
    assert got.loss_sum.dtype == torch.float32
    torch.testing.assert_close(got.loss_sum, want, **BF16)
    torch.testing.assert_close(got.token_losses, want_tokens, **BF16)
    got_grads = _grads(got.loss_sum, hidden, weight)
    for a, b in zip(got_grads, _grads(want, hidden, weight), strict=True):
        assert a.dtype == torch.float32  # the inputs' dtype, not the autocast dtype
        torch.testing.assert_close(a, b, **BF16)


def test_bf16_inputs_get_bf16_gradients():
    hidden, weight, labels = _inputs(torch.bfloat16)
    got = linear_cross_entropy(hidden, weight, labels, chunk_tokens=4, z_loss_weight=0.0)
    want, _ = _plain(hidden, weight, labels, 0.0)
    torch.testing.assert_close(got.loss_sum, want, **BF16)
    got_grads = _grads(got.loss_sum, hidden, weight)
    for a, b in zip(got_grads, _grads(want, hidden, weight), strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a, b, **BF16)


def _saved_sizes(fn) -> list[int]:
    """The element counts of every tensor autograd saves while ``fn`` runs."""
    sizes: list[int] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        sizes.append(tensor.numel())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        fn()
    return sizes


@pytest.mark.parametrize("chunk_tokens", [4, 0])
def test_the_graph_saves_no_logits_sized_tensor(chunk_tokens):
    hidden, weight, labels = _inputs()
    chunked = _saved_sizes(
        lambda: linear_cross_entropy(
            hidden, weight, labels, chunk_tokens=chunk_tokens, z_loss_weight=0.1
        )
    )
    plain = _saved_sizes(lambda: _plain(hidden, weight, labels, 0.1))
    assert chunked and max(chunked) < N * V
    assert N * V in plain


# --- through the Transformer ---------------------------------------------------------------


def _model(**overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    fields: dict = dict(dim=32, n_layers=2, n_heads=2, vocab_size=V, max_seq_len=16)
    fields.update(overrides)
    return build_model(ModelConfig(**fields))


def _ids_and_labels():
    """24 tokens: their logits' size is no weight's (the model's dim is 32)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, 12), generator=generator)
    labels = torch.randint(0, V, (B, 12), generator=generator)
    labels[:, :3] = IGNORE_INDEX
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    return ids, labels, doc_ids


@pytest.mark.parametrize("tie", [False, True])
def test_the_model_with_labels_equals_the_loss_of_its_logits(tie):
    model = _model(tie_embeddings=tie)
    ids, labels, doc_ids = _ids_and_labels()
    spec = HeadLossSpec(chunk_tokens=5, z_loss_weight=0.01)
    got = model(ids, doc_ids=doc_ids, labels=labels, loss_spec=spec)
    assert isinstance(got, HeadLoss)
    got_grads = torch.autograd.grad(got.loss_sum, list(model.parameters()))
    logits = model(ids, doc_ids=doc_ids)
    want = build_loss_fn(TrainConfig(z_loss_weight=0.01))(logits, labels)
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    # The chunked head's sums differ in order, and its gradient runs back through the
    # whole model: the model's chain plus the sum over the tokens.
    forward = transformer_terms(model.cfg, 12, backward=False) + ids.numel()
    assert_reordered_close(got.loss_sum, want, terms=forward)
    want_tokens = token_losses(logits.detach(), labels, 0.01)
    assert_reordered_close(got.token_losses, want_tokens, terms=forward)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert_reordered_close(a, b, terms=transformer_terms(model.cfg, 12) + ids.numel())


def test_the_model_with_labels_saves_no_logits_sized_tensor():
    model = _model()
    ids, labels, doc_ids = _ids_and_labels()
    logits_size = ids.numel() * V
    spec = HeadLossSpec(chunk_tokens=8)
    chunked = _saved_sizes(lambda: model(ids, doc_ids=doc_ids, labels=labels, loss_spec=spec))
    plain = _saved_sizes(lambda: build_loss_fn(TrainConfig())(model(ids, doc_ids), labels))
    assert logits_size not in chunked
    assert logits_size in plain


# --- the step and eval ---------------------------------------------------------------------


def _session(overrides: list[str]):
    config = load_config(None, overrides)
    config.validate(1)
    return build_session(config, RuntimeContext())


def test_text_step_gives_the_same_loss_and_gradients_with_and_without_chunks(tiny_overrides):
    common = [*tiny_overrides, "--train.grad_accum_steps=2", "--train.z_loss_weight=0.01"]
    plain = _session([*common, "--train.loss_chunk_tokens=0"])
    chunked = _session([*common, "--train.loss_chunk_tokens=24"])  # 128 tokens: uneven chunks
    want, got = text_step(plain, 0), text_step(chunked, 0)
    # Chunked and whole-logits losses sum in different orders: the model's chain plus the
    # 2 * 128 tokens of the step; the gradients run the chain back, and their norm moves
    # no more than they do, relatively.
    cfg, tokens = plain.config.model, 2 * 4 * 32
    forward = transformer_terms(cfg, 32, backward=False) + tokens
    backward = transformer_terms(cfg, 32) + tokens
    assert got.loss == pytest.approx(
        want.loss, rel=0, abs=reorder_atol(torch.float32, forward, want.loss)
    )
    grad_norm_atol = reorder_atol(torch.float32, backward, want.grad_norm)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=0, abs=grad_norm_atol)
    named = dict(chunked.model.named_parameters())
    for name, param in plain.model.named_parameters():
        assert_reordered_close(named[name].grad, param.grad, terms=backward)


def test_a_replaced_loss_fn_is_called_with_the_logits_even_with_chunks_on(tiny_overrides):
    session = _session([*tiny_overrides, "--train.loss_chunk_tokens=24"])
    seen = []
    builtin = session.loss_fn

    def doubled(logits, labels):
        seen.append(logits.shape)
        return 2 * builtin(logits, labels)

    reference = text_step(_session([*tiny_overrides, "--train.loss_chunk_tokens=24"]), 0)
    session.loss_fn = doubled
    result = text_step(session, 0)
    assert seen and seen[0][-1] == session.config.model.vocab_size
    # The whole logits against the chunked head: the model's chain and 128 tokens, reordered.
    terms = transformer_terms(session.config.model, 32, backward=False) + 4 * 32
    atol = reorder_atol(torch.float32, terms, 2 * reference.loss)
    assert result.loss == pytest.approx(2 * reference.loss, rel=0, abs=atol)


def test_eval_gives_the_same_loss_with_and_without_chunks(tiny_overrides):
    whole = _session([*tiny_overrides, "--train.loss_chunk_tokens=0"])
    plain = evaluate(whole.model, whole.data, whole.config, whole.runtime)
    chunks = _session([*tiny_overrides, "--train.loss_chunk_tokens=24"])
    chunked = evaluate(chunks.model, chunks.data, chunks.config, chunks.runtime)
    assert chunked["eval_tokens"] == plain["eval_tokens"] > 0
    # Chunked and whole-logits losses: the model's chain and the tokens evaluated, reordered.
    terms = transformer_terms(whole.config.model, 32, backward=False) + plain["eval_tokens"]
    atol = reorder_atol(torch.float32, terms, plain["eval_loss"])
    assert chunked["eval_loss"] == pytest.approx(plain["eval_loss"], rel=0, abs=atol)
