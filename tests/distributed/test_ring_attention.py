"""Ring attention (model/attention/ring.py) on real gloo ranks against one process's
attention over the whole sequence: outputs and the gradients of q, k and v, with random
packed documents and sliding windows, with and without grouped-query heads, for a ring of
2 and of 4 ranks and a ring of 2 Ulysses pairs; then a whole model under each, and a model
whose layers alternate sliding and full attention against one process's dense masks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from kempnerforge.config.model import ModelConfig
from kempnerforge.distributed.parallelize import apply_compile
from kempnerforge.model.attention import (
    MaskRule,
    SequenceSplit,
    dense_mask,
    held_spans,
    prepare_masks,
    ring_attention,
    set_attention_kernel,
    set_sequence_split,
)
from kempnerforge.model.transformer import Transformer
from tests.support.dist import run_distributed
from tests.support.tolerance import assert_reordered_close, transformer_terms

pytestmark = pytest.mark.distributed

BATCH, SEQ, HEADS, HEAD_DIM = 2, 64, 4, 8
CASES = {
    # cp: [(ring, kv_heads, documents, window), ...]; ring < cp is a ring of Ulysses groups.
    2: [(2, 4, False, 0), (2, 2, True, 0), (2, 1, True, 6)],
    4: [(4, 2, True, 0), (4, 4, True, 11), (4, 1, False, 5), (2, 2, True, 9), (2, 4, False, 0)],
}


def _split(rank: int, world_size: int, ring: int) -> SequenceSplit:
    """This rank's split of the world into a ring of ``ring`` ranks; with fewer ring ranks
    than ranks, each ring rank a group of consecutive ranks exchanging heads (every rank
    creates every group, as the mesh does)."""
    ulysses = world_size // ring
    groups = [list(range(i * ulysses, (i + 1) * ulysses)) for i in range(ring)]
    made = [dist.new_group(g) for g in groups] if 1 < ulysses < world_size else None
    mine = made[rank // ulysses] if made else None
    return SequenceSplit(dist.group.WORLD, rank, world_size, ring=ring, ulysses_group=mine)


def _one_case(rank: int, world_size: int, ring: int, kv: int, docs: bool, window: int) -> dict:
    """Ring attention of this rank's positions against float64 attention of the whole
    sequence on every rank (same seed): (got, want) for the output and q, k, v's grads."""
    generator = torch.Generator().manual_seed(ring * 100 + kv * 10 + window)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, SEQ, kv, HEAD_DIM, generator=generator) for _ in range(2))
    grad = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=generator)
    # Documents of random lengths, about 12 tokens on average.
    starts = torch.rand(BATCH, SEQ, generator=generator) < 1 / 12
    ids = torch.cumsum(starts.long(), 1) if docs else None
    rule = MaskRule(documents=docs, window=window)
    mask = dense_mask(rule, ids, (0, SEQ), (0, SEQ))
    whole = [t.double().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in whole), attn_mask=mask, enable_gqa=kv < HEADS
    ).transpose(1, 2)
    want.backward(grad.double())

    split = _split(rank, world_size, ring)
    mine = torch.cat([torch.arange(a, b) for a, b in held_spans(rank, world_size, SEQ, ring)])
    local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
    (ring_mask,) = prepare_masks([rule], ids, BATCH, SEQ, torch.device("cpu"), ring=ring)
    out = ring_attention(*local, split, ring_mask)
    out.backward(grad[:, mine])
    pairs = {"out": (out.detach(), want.detach()[:, mine])}
    for name, got, reference in zip("qkv", local, whole, strict=True):
        pairs[f"d{name}"] = (got.grad, reference.grad[:, mine])
    # The largest |score|, for the bound.
    keys = k.double().repeat_interleave(HEADS // kv, 2).transpose(1, 2)
    scores = q.double().transpose(1, 2) @ keys.mT
    return {"pairs": pairs, "max_score": float(scores.abs().max()) / math.sqrt(HEAD_DIM)}


def _every_case(rank: int, world_size: int) -> list[dict]:
    return [_one_case(rank, world_size, *case) for case in CASES[world_size]]


def _attention_terms(max_score: float, ring: int) -> int:
    """The sums along the longest chain of ring attention against one softmax: the scores'
    dot products (HEAD_DIM terms each; the exponential turns their rounding into a
    relative error of each weight, scaled by the largest |score|), the softmax's
    normaliser and the weighted values (SEQ keys each), and the ring's merges (a
    log-sum-exp and a rescaling per step); backward runs the chain again and sums the
    key and value gradients over SEQ queries, in the ring's order."""
    forward = math.ceil(HEAD_DIM * max(1.0, max_score)) + 2 * SEQ + 4 * ring
    return 2 * forward + SEQ


@pytest.mark.parametrize("cp", sorted(CASES), ids=[f"cp{cp}" for cp in sorted(CASES)])
def test_ring_attention_gives_each_rank_its_rows_of_one_process_attention(cp):
    """Each rank's output rows and its q, k, v gradients equal float64 attention over the
    whole sequence within fp32 rounding of the chain: documents and windows hide keys in
    the same way, grouped key/value heads (1 or 2 for 4 query heads) are read and their
    gradients summed as one process does, and the blocks merge exactly."""
    records = run_distributed(_every_case, cp)
    for index, case in enumerate(CASES[cp]):
        for record in records:
            result = record[index]
            terms = _attention_terms(result["max_score"], case[0])
            for name, (got, want) in result["pairs"].items():
                try:
                    assert_reordered_close(got, want.float(), terms=terms, dtype=torch.float32)
                except AssertionError as e:
                    raise AssertionError(f"ring, kv, docs, window = {case}: {name}: {e}") from e


def _model_case(rank: int, world_size: int, ring: int, compiled: bool = False) -> dict:
    """A GQA Transformer with packed documents, whole and as this rank's positions under
    the ring (its blocks compiled with ``compiled``): (logits, gradients summed over the
    ranks) against the whole run's."""
    torch.manual_seed(0)
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
    model = Transformer(cfg)
    ids = torch.randint(0, 64, (2, 32))
    doc_ids = torch.tensor([[0] * 5 + [1] * 19 + [2] * 8, [0] * 27 + [1] * 5])
    model(ids, doc_ids).float().pow(2).sum().backward()
    whole_logits = model(ids, doc_ids).detach()
    whole_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_sequence_split(model, _split(rank, world_size, ring))
    if compiled:
        torch._dynamo.reset()
        apply_compile(model, backend="aot_eager")
    mine = torch.cat([torch.arange(a, b) for a, b in held_spans(rank, world_size, 32, ring)])
    logits = model(ids[:, mine], doc_ids)
    logits.float().pow(2).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)  # the ranks' gradients sum to the whole sequence's
        grads[name] = param.grad
    return {"logits": (logits.detach(), whole_logits[:, mine]), "grads": (grads, whole_grads)}


def _model_cases(rank: int, world_size: int) -> list[dict]:
    cases = [(4, False), (2, False), (4, True)]
    return [_model_case(rank, world_size, ring, compiled) for ring, compiled in cases]


def test_a_model_under_a_ring_and_under_a_ring_of_ulysses_pairs_is_one_process():
    """4 ranks as a ring of 4, as a ring of 2 pairs that exchange heads, and as a ring of
    4 with compiled blocks (ring attention runs eagerly between their graphs): each rank's
    logits are its (zigzag) positions of the whole forward, RoPE at their global
    positions, and the gradients sum to the whole sequence's."""
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
    logit_terms = transformer_terms(cfg, 32, backward=False)
    grad_terms = transformer_terms(cfg, 32) + 2 * 32
    for ranks in zip(*run_distributed(_model_cases, 4), strict=True):
        for record in ranks:
            assert_reordered_close(*record["logits"], terms=logit_terms)
            grads, whole = record["grads"]
            for name, grad in grads.items():
                assert_reordered_close(grad, whole[name], terms=grad_terms)


WINDOWED = ModelConfig(
    dim=32,
    n_layers=3,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    max_seq_len=32,
    sliding_window=6,
    sliding_window_pattern=2,
)
"""Layers 0 and 2 see 6 positions back, layer 1 the whole causal past (Gemma 2's
alternation): two rules, one shared by two layers. A window of 6 cuts the ring's chunks
(4 positions in a ring of 4, 8 in a ring of 2) partway, so every kind of chunk pair
occurs: skipped, whole, causal and masked."""


def _windowed_case(rank: int, world_size: int, ring: int) -> dict:
    """WINDOWED over packed documents: one process with the dense (batch, 1, seq, seq)
    masks (train.attention_kernel = 'dense'), then this rank's positions under the ring:
    (logits, gradients summed over the ranks) against the reference's."""
    torch.manual_seed(0)
    model = Transformer(WINDOWED)
    ids = torch.randint(0, 64, (2, 32))
    doc_ids = torch.tensor([[0] * 5 + [1] * 19 + [2] * 8, [0] * 11 + [1] * 16 + [2] * 5])
    set_attention_kernel(model, "dense")
    whole_logits = model(ids, doc_ids)
    whole_logits.float().pow(2).sum().backward()
    whole_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    set_attention_kernel(model, "auto")
    set_sequence_split(model, _split(rank, world_size, ring))
    mine = torch.cat([torch.arange(a, b) for a, b in held_spans(rank, world_size, 32, ring)])
    logits = model(ids[:, mine], doc_ids)
    logits.float().pow(2).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        dist.all_reduce(param.grad)  # the ranks' gradients sum to the whole sequence's
        grads[name] = param.grad
    pairs = {"logits": (logits.detach(), whole_logits.detach()[:, mine])}
    return pairs | {"grads": (grads, whole_grads)}


def _windowed_cases(rank: int, world_size: int) -> list[dict]:
    return [_windowed_case(rank, world_size, ring) for ring in (4, 2)]


def test_alternating_sliding_and_full_layers_over_documents_under_a_ring_are_one_process():
    """4 ranks as a ring of 4 and as a ring of 2 Ulysses pairs: each layer's own rule
    (its window or none, and the documents) decides its chunk pairs, so each rank's logits
    are its positions of one process's forward with dense masks, and the gradients sum to
    that process's, forward and backward."""
    seq, batch, layers = 32, 2, WINDOWED.n_layers
    cases = zip(*run_distributed(_windowed_cases, 4), strict=True)
    for ranks, ring in zip(cases, (4, 2), strict=True):
        # One process's chain (transformer_terms), plus the ring's merge of each layer's
        # blocks (a log-sum-exp and a rescaling per ring step); backward runs it twice
        # and each weight's gradient sums over the batch's positions in another order
        # (each rank's share, then the all-reduce).
        merges = 2 * ring * layers
        logit_terms = transformer_terms(WINDOWED, seq, backward=False) + merges
        grad_terms = 2 * logit_terms + batch * seq
        for record in ranks:
            assert_reordered_close(*record["logits"], terms=logit_terms)
            grads, whole = record["grads"]
            for name, grad in grads.items():
                assert_reordered_close(grad, whole[name], terms=grad_terms)


SINK_CASES = [(2, 2, True, 6), (2, 4, False, 0)]
"""(ring, kv_heads, documents, window) of the sink cases, on 2 ranks."""


def _sink_case(rank: int, world_size: int, ring: int, kv: int, docs: bool, window: int) -> dict:
    """Ring attention with attention sinks against float64 attention over the whole
    sequence with one more key per head (logit the head's sink, value zero): output, q,
    k, v gradients of this rank's rows, and this rank's share of the sinks' gradient."""
    generator = torch.Generator().manual_seed(7 + ring * 100 + kv * 10 + window)
    q = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=generator)
    k, v = (torch.randn(BATCH, SEQ, kv, HEAD_DIM, generator=generator) for _ in range(2))
    sinks = 2.0 + 2.0 * torch.randn(HEADS, generator=generator)
    grad = torch.randn(BATCH, SEQ, HEADS, HEAD_DIM, generator=generator)
    starts = torch.rand(BATCH, SEQ, generator=generator) < 1 / 12
    ids = torch.cumsum(starts.long(), 1) if docs else None
    rule = MaskRule(documents=docs, window=window)
    seen = dense_mask(rule, ids, (0, SEQ), (0, SEQ))
    whole = [t.double().requires_grad_() for t in (q, k, v, sinks)]
    wq, wk, wv, ws = whole
    keys = wk.repeat_interleave(HEADS // kv, 2).transpose(1, 2)
    values = wv.repeat_interleave(HEADS // kv, 2).transpose(1, 2)
    scores = (wq.transpose(1, 2) @ keys.mT / math.sqrt(HEAD_DIM)).masked_fill(~seen, -math.inf)
    sink = ws[None, :, None, None].expand(*scores.shape[:3], 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
    want = (probs @ values).transpose(1, 2)
    want.backward(grad.double())

    split = _split(rank, world_size, ring)
    mine = torch.cat([torch.arange(a, b) for a, b in held_spans(rank, world_size, SEQ, ring)])
    local = [t[:, mine].clone().requires_grad_() for t in (q, k, v)]
    local_sinks = sinks.clone().requires_grad_()
    (ring_mask,) = prepare_masks([rule], ids, BATCH, SEQ, torch.device("cpu"), ring=ring)
    out = ring_attention(*local, split, ring_mask, local_sinks)
    out.backward(grad[:, mine])
    pairs = {"out": (out.detach(), want.detach()[:, mine])}
    for name, got, reference in zip("qkv", local, whole[:3], strict=True):
        pairs[f"d{name}"] = (got.grad, reference.grad[:, mine])
    max_score = float(scores.detach().abs().nan_to_num(posinf=0).max())
    return {"pairs": pairs, "d_sinks": (local_sinks.grad, ws.grad), "max_score": max_score}


def _every_sink_case(rank: int, world_size: int) -> list[dict]:
    return [_sink_case(rank, world_size, *case) for case in SINK_CASES]


def test_ring_attention_with_sinks_is_one_process_attention_with_a_null_key():
    """The sink is one more term of the merged log-sum-exp: each rank's rows and q, k, v
    gradients equal one process's, and the ranks' sink gradients sum to its own."""
    records = run_distributed(_every_sink_case, 2)
    for index, case in enumerate(SINK_CASES):
        terms = _attention_terms(max(r[index]["max_score"] for r in records), case[0])
        for record in records:
            for name, (got, want) in record[index]["pairs"].items():
                try:
                    assert_reordered_close(got, want.float(), terms=terms, dtype=torch.float32)
                except AssertionError as e:
                    raise AssertionError(f"ring, kv, docs, window = {case}: {name}: {e}") from e
        got = sum(record[index]["d_sinks"][0] for record in records)
        want = records[0][index]["d_sinks"][1]
        # Every row's dy . y (HEAD_DIM terms) summed over both ranks' rows.
        sink_terms = terms + HEAD_DIM + BATCH * SEQ
        assert_reordered_close(got, want.float(), terms=sink_terms, dtype=torch.float32)
