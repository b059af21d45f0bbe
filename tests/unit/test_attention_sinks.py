"""Attention sinks (model/attention/sinks.py) in every kernel that carries them, against
float64 attention written out with the sink as one more key (its logit the sink, its
value zero): the CPU's pieces (segments.py) forward and backward, the sink's own
gradient included, under causality alone, packed documents and sliding windows, with and
without grouped key/value heads; the dense kernel; FlexAttention's forward (its backward
is CUDA's alone); and a model's layers with sinks."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention import MaskRule, attend, block_mask, dense_mask, prepare_masks
from kempnerforge.model.attention.kernels import _flex
from kempnerforge.model.attention.segments import Segments
from kempnerforge.model.transformer import Transformer
from tests.support.tolerance import assert_reordered_close, transformer_terms
from tests.unit.test_attention_masks import (
    DOC_LENGTHS,
    HEAD_DIM,
    RULE_IDS,
    RULES,
    SEQ,
    attention_terms,
    doc_ids_of,
    random_qkv,
)

SINK_RULES = [MaskRule(), *RULES]
SINK_RULE_IDS = ["causal", *RULE_IDS]


def random_sinks(seed: int = 2) -> torch.Tensor:
    """Four heads' sinks near a row's log-sum-exp (a few units here), so the sink takes a
    share of each softmax far from 0 and from 1."""
    gen = torch.Generator().manual_seed(seed)
    return (2.0 + 2.0 * torch.randn(4, generator=gen)).requires_grad_()


def null_key_attention(q, k, v, sinks, seen) -> torch.Tensor:
    """Float64 attention with one more key per head: a score of the head's sink, seen by
    every query, and a value of zeros; key/value heads repeated to their query heads."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~seen, -math.inf)
    sink = sinks.double()[None, :, None, None].expand(*scores.shape[:3], 1)
    null_value = torch.zeros(*v.shape[:2], 1, v.shape[-1], dtype=torch.float64)
    probs = torch.cat([scores, sink], -1).softmax(-1)
    return probs @ torch.cat([v, null_value], -2)


def assert_forward_backward_close(got, want, inputs, seed: int = 1) -> None:
    """Output and the gradients of ``inputs`` (q, k, v, sinks) within fp32 rounding of
    the chain (tests/unit/test_attention_masks.py's bounds), the sinks' gradient summing
    every row of every head once more (batch * SEQ terms of dy . y, HEAD_DIM each)."""
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(seed))
    got_grads = torch.autograd.grad(got, inputs, grad)
    want_grads = torch.autograd.grad(want, inputs, grad.double())
    magnitude = 2 * float(inputs[2].detach().abs().max())
    assert_reordered_close(
        got, want, terms=attention_terms(SEQ), magnitude=magnitude, dtype=torch.float32
    )
    scale = max(float(g.abs().max()) for g in want_grads[:3])
    for got_grad, want_grad in zip(got_grads[:3], want_grads[:3], strict=True):
        assert_reordered_close(
            got_grad, want_grad, terms=attention_terms(SEQ, backward=True), magnitude=scale
        )
    rows = got.shape[0] * got.shape[2]
    sink_terms = attention_terms(SEQ, backward=True) + HEAD_DIM + rows
    # Each row's term is at most |dy| |y| <= HEAD_DIM max|dy| max|v|.
    row_scale = HEAD_DIM * float(grad.abs().max()) * float(inputs[2].detach().abs().max())
    assert_reordered_close(
        got_grads[3], want_grads[3], terms=sink_terms, magnitude=rows * row_scale
    )


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("rule", SINK_RULES, ids=SINK_RULE_IDS)
def test_the_cpu_kernel_with_sinks_equals_a_null_key_forward_and_backward(rule, kv_heads):
    """Pieces of documents and windows (and causality alone, which sinks prepare as
    pieces too: SDPA's causal kernel gives no log-sum-exp)."""
    doc_ids = doc_ids_of(DOC_LENGTHS)
    (mask,) = prepare_masks([rule], doc_ids, 2, SEQ, torch.device("cpu"), lse=True)
    assert isinstance(mask, Segments)
    q, k, v = random_qkv(kv_heads)
    sinks = random_sinks()
    got = attend(q, k, v, mask, sinks)
    want = null_key_attention(q, k, v, sinks, dense_mask(rule, doc_ids, (0, SEQ), (0, SEQ)))
    assert_forward_backward_close(got, want, (q, k, v, sinks))


@pytest.mark.parametrize("rule", [MaskRule(), MaskRule(documents=True, window=150)])
def test_the_dense_kernel_with_sinks_equals_a_null_key_forward_and_backward(rule):
    doc_ids = doc_ids_of(DOC_LENGTHS)
    (mask,) = prepare_masks([rule], doc_ids, 2, SEQ, torch.device("cpu"), "dense", lse=True)
    assert isinstance(mask, torch.Tensor)
    q, k, v = random_qkv(2)
    sinks = random_sinks()
    got = attend(q, k, v, mask, sinks)
    want = null_key_attention(q, k, v, sinks, dense_mask(rule, doc_ids, (0, SEQ), (0, SEQ)))
    assert_forward_backward_close(got, want, (q, k, v, sinks))


def test_flex_attention_with_sinks_equals_a_null_key_forward():
    """The GPU's path (a block mask, FlexAttention's log-sum-exp) run eagerly on the CPU,
    forward only: its log-sum-exp is the natural one the sink weight needs."""
    rule = MaskRule(documents=True, window=150)
    doc_ids = doc_ids_of(DOC_LENGTHS)
    mask = block_mask(rule, doc_ids, (0, SEQ), (0, SEQ), device="cpu")
    q, k, v = (t.detach() for t in random_qkv(2))
    sinks = random_sinks().detach()
    with torch.no_grad():
        got = _flex(flex_attention, q, k, v, mask, True, sinks)
        want = null_key_attention(q, k, v, sinks, dense_mask(rule, doc_ids, (0, SEQ), (0, SEQ)))
    magnitude = 2 * float(v.abs().max())
    assert_reordered_close(
        got, want, terms=attention_terms(SEQ), magnitude=magnitude, dtype=torch.float32
    )


def test_a_model_with_sinks_is_its_dense_kernel_forward_and_backward():
    """The whole model (sliding and full layers over packed documents, grouped heads):
    the CPU's pieces equal the dense kernel, logits and every gradient, sinks included."""
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=64,
        max_seq_len=64,
        attention_sinks=True,
        attention_bias=True,
        sliding_window=8,
        sliding_window_pattern=2,
    )
    torch.manual_seed(0)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("attention.sinks"):
                param.normal_(2.0, 1.0)
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(3))
    doc_ids = torch.tensor([[0] * 25 + [1] * 15, [0] * 40])
    results = []
    for kernel in ("auto", "dense"):
        model.attention_kernel = kernel
        model.zero_grad()
        logits = model(ids, doc_ids)
        assert isinstance(logits, torch.Tensor)
        logits.square().mean().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logits.detach(), grads))
    (auto, auto_grads), (dense, dense_grads) = results
    assert set(auto_grads) == {n for n, _ in model.named_parameters()}
    # Two fp32 orders of the same chain (tests/support/tolerance.py), at each value's scale.
    forward = transformer_terms(cfg, 40, backward=False)
    assert_reordered_close(auto, dense, terms=forward, dtype=torch.float32)
    backward = transformer_terms(cfg, 40) + 2 * 40  # and the loss's mean over positions
    for name, grad in auto_grads.items():
        want = dense_grads[name]
        assert_reordered_close(grad, want, terms=backward, magnitude=float(want.abs().max()))
