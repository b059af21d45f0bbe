"""The mask rules (model/attention/masks.py) and the kernels that apply them (kernels.py,
segments.py) against a plain masked softmax in float64: on random packed documents and
sliding windows, forward and backward, with and without grouped key/value heads."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import flex_attention

from kempnerforge.model.attention import (
    BLOCK_SIZE,
    MaskRule,
    attend,
    block_mask,
    dense_mask,
    mask_mod,
    prepare_masks,
    visible,
)
from kempnerforge.model.attention.segments import MERGE_LEN, Segments, plan_segments
from tests.support.tolerance import assert_reordered_close, unit_roundoff

HEAD_DIM = 16
SEQ = 1100
"""Long enough for a document several windows long (several bands), one past MERGE_LEN
without, several merged short ones, and tiles cut short by the end (not a multiple of
BLOCK_SIZE)."""
DOC_LENGTHS = [
    [700, 20, 15, 5, 3, 200, 157],  # a banded document, short ones merged, two alone
    [40, 300, 1, 1, 600, 158],  # documents of one token, a long one
]
RULES = [
    MaskRule(documents=True),
    MaskRule(documents=True, window=150),
    MaskRule(window=150),
    MaskRule(documents=True, window=1),
]
RULE_IDS = ["documents", "documents+window", "window", "window-1"]


def doc_ids_of(lengths: list[list[int]]) -> torch.Tensor:
    """(batch, seq) ids counting each row's documents from 0."""
    rows = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    return torch.stack(rows)


def reference_attention(q, k, v, seen) -> torch.Tensor:
    """Softmax attention written out in float64: scores, -inf where not seen, softmax,
    weighted values; key/value heads repeated to their query heads."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double(), v.double()
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v


def random_qkv(kv_heads: int, seed: int = 0, batch: int = 2, seq: int = SEQ):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, 4, seq, HEAD_DIM), *[(batch, kv_heads, seq, HEAD_DIM)] * 2]
    return [torch.randn(s, generator=gen).requires_grad_() for s in shapes]


def attention_terms(keys: int, backward: bool = False) -> int:
    """The sums along attention's chain: the scores (HEAD_DIM), the softmax's normaliser
    and the weighted values (keys each); backward runs the chain back and sums each key's
    gradient over the queries that see it (keys again)."""
    forward = HEAD_DIM + 2 * keys
    return 2 * forward + keys if backward else forward


def test_the_rule_sees_the_past_its_document_and_its_window():
    q, k = torch.tensor(10), torch.arange(12)
    assert visible(MaskRule(), q, k).tolist() == [True] * 11 + [False]
    window = visible(MaskRule(window=3), q, k)
    assert torch.nonzero(window).flatten().tolist() == [8, 9, 10]
    docs = torch.tensor([0] * 9 + [1] * 3)
    seen = visible(MaskRule(documents=True, window=3), q, k, docs[10], docs)
    assert torch.nonzero(seen).flatten().tolist() == [9, 10]
    with pytest.raises(ValueError, match="document ids"):
        visible(MaskRule(documents=True), q, k)


def _tile_tables(mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full) boolean (batch, query tiles, key tiles) of a BlockMask."""

    def table(num, idx) -> torch.Tensor:
        out = torch.zeros(*idx.shape[:2], idx.shape[2], idx.shape[3] + 1, dtype=torch.bool)
        cols = torch.arange(idx.shape[3])
        kept = cols[None, None, None] < num[..., None]
        out.scatter_(-1, torch.where(kept, idx.long(), idx.shape[3]), True)
        return out[:, 0, :, :-1]

    return table(mask.kv_num_blocks, mask.kv_indices), table(
        mask.full_kv_num_blocks, mask.full_kv_indices
    )


@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
@pytest.mark.parametrize(
    ("q_range", "k_range"),
    [((0, SEQ), (0, SEQ)), ((384, 700), (128, 700)), ((640, 1100), (0, 256))],
    ids=["whole", "diagonal-pair", "past-pair"],
)
def test_a_block_mask_skips_only_empty_tiles_and_calls_full_only_full_ones(rule, q_range, k_range):
    """For the whole sequence and for (query range, key range) pairs as a ring of key
    blocks asks for them: every visible pair lies in a partial or full tile, every pair of
    a full tile is visible, and the mask_mod equals the dense rule position by position."""
    doc_ids = doc_ids_of(DOC_LENGTHS)
    mask = block_mask(rule, doc_ids, q_range, k_range)
    seen = dense_mask(rule, doc_ids, q_range, k_range)[:, 0]
    partial, full = _tile_tables(mask)
    assert not (partial & full).any()
    q_len, k_len = q_range[1] - q_range[0], k_range[1] - k_range[0]
    for qt in range(partial.shape[1]):
        for kt in range(partial.shape[2]):
            rows = slice(qt * BLOCK_SIZE, min((qt + 1) * BLOCK_SIZE, q_len))
            cols = slice(kt * BLOCK_SIZE, min((kt + 1) * BLOCK_SIZE, k_len))
            tile = seen[:, rows, cols]
            covered = partial[:, qt, kt] | full[:, qt, kt]
            assert not (tile.flatten(1).any(1) & ~covered).any(), (qt, kt)
            assert not (full[:, qt, kt] & ~tile.flatten(1).all(1)).any(), (qt, kt)
    rule_mask = mask_mod(rule, doc_ids, q_range[0], k_range[0])
    b, qi, ki = torch.meshgrid(
        torch.arange(2), torch.arange(q_len), torch.arange(k_len), indexing="ij"
    )
    assert torch.equal(rule_mask(b, 0, qi, ki), seen.expand(2, q_len, k_len))


def test_a_block_mask_skips_most_tiles_of_short_documents_and_windows():
    """The point of the block mask: the work is the visible tiles, not seq**2."""
    doc_ids = doc_ids_of([[256] * 4])
    documents = block_mask(MaskRule(documents=True), doc_ids, (0, 1024), (0, 1024))
    partial, full = _tile_tables(documents)
    # Each document two tiles: both diagonal tiles partial, the one below them full; the
    # causal mask alone would visit 36 tiles.
    assert int(partial.sum()) == 8 and int(full.sum()) == 4
    partial, full = _tile_tables(block_mask(MaskRule(window=256), None, (0, 1024), (0, 1024)))
    assert int((partial | full).sum()) == 8 + 7 + 6  # the diagonal band of 3 tiles


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("rule", RULES, ids=RULE_IDS)
def test_the_cpu_kernel_equals_a_float64_masked_softmax_forward_and_backward(rule, kv_heads):
    doc_ids = doc_ids_of(DOC_LENGTHS)
    (mask,) = prepare_masks([rule], doc_ids, 2, SEQ, torch.device("cpu"))
    assert isinstance(mask, Segments)
    q, k, v = random_qkv(kv_heads)
    got = attend(q, k, v, mask)
    seen = dense_mask(rule, doc_ids, (0, SEQ), (0, SEQ))
    want = reference_attention(q, k, v, seen)
    grad = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad.double())
    # fp32 kernels against float64, which is exact at this scale: each output sums the
    # scores' HEAD_DIM products, then its keys twice (softmax and values), at most SEQ.
    # The values are of unit scale and the output is their convex combination, so the
    # largest |v| bounds the terms' sum; each score's error reaches the output through a
    # factor of at most 2 max|v|, included by doubling the magnitude.
    magnitude = 2 * float(v.detach().abs().max())
    assert_reordered_close(
        got, want, terms=attention_terms(SEQ), magnitude=magnitude, dtype=torch.float32
    )
    # Backward sums the same chain back, then each key's gradient over its queries. Its
    # terms (p * dp, ds * k, p * grad) are of the scale of the largest of the three
    # gradients; one gradient may be exactly 0 (a window of 1: no query's softmax depends
    # on its score), so their common scale stands in for each.
    scale = max(float(g.abs().max()) for g in want_grads)
    for got_grad, want_grad in zip(got_grads, want_grads, strict=True):
        assert_reordered_close(
            got_grad, want_grad, terms=attention_terms(SEQ, backward=True), magnitude=scale
        )


def test_the_cpu_plan_merges_short_documents_bands_long_ones_and_skips_masks_where_causal():
    window = 150
    segments = plan_segments(
        MaskRule(documents=True, window=window), doc_ids_of(DOC_LENGTHS), 2, SEQ
    )
    for row in range(len(DOC_LENGTHS)):
        pieces = [p for p in segments.pieces if p.row == row]
        # The queries of a row are cut into pieces without gap or overlap.
        assert pieces[0].q[0] == 0 and pieces[-1].q[1] == SEQ
        assert all(a.q[1] == b.q[0] for a, b in zip(pieces, pieces[1:], strict=False))
        assert all(p.k[1] == p.q[1] for p in pieces)  # no key past the last query
    row0 = [p for p in segments.pieces if p.row == 0]
    # The 700-token document: bands of the window's length, each reading the window - 1
    # positions before it; the first needs no mask (its triangle is within the window).
    bands = [p for p in row0 if p.q[1] <= 700]
    assert [p.q[0] for p in bands] == list(range(0, 700, window))
    assert bands[0].causal and bands[0].k == (0, window)
    assert all(p.k[0] == p.q[0] - window + 1 and not p.causal for p in bands[1:])
    # The documents after it (20 to 200 tokens, under MERGE_LEN) merge into one piece
    # under their own mask; it reaches MERGE_LEN only with the last.
    merged = row0[len(bands)]
    assert merged.q == merged.k == (700, SEQ) and not merged.causal and not merged.shared
    assert MERGE_LEN <= SEQ - 700
    # Without a window a long document is one causal piece.
    plain = plan_segments(MaskRule(documents=True), doc_ids_of(DOC_LENGTHS), 2, SEQ)
    assert plain.pieces[0].q == (0, 700) and plain.pieces[0].causal


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_flex_attention_with_the_block_mask_equals_the_reference_forward(kv_heads):
    """FlexAttention's eager forward (the CPU has no flex backward in this PyTorch; the GPU
    check in bench/gpu runs forward and backward) with the rule's block mask and mask_mod;
    a document rule with a window, over a (query range, key range) pair too."""
    rule = MaskRule(documents=True, window=150)
    doc_ids = doc_ids_of(DOC_LENGTHS)
    q, k, v = (t.detach() for t in random_qkv(kv_heads))
    for q_range, k_range in [((0, SEQ), (0, SEQ)), ((640, 1100), (384, 1100))]:
        mask = block_mask(rule, doc_ids, q_range, k_range)
        qs, ks = slice(*q_range), slice(*k_range)
        got = flex_attention(
            q[:, :, qs], k[:, :, ks], v[:, :, ks], block_mask=mask, enable_gqa=True
        )
        seen = dense_mask(rule, doc_ids, q_range, k_range)
        want = reference_attention(q[:, :, qs], k[:, :, ks], v[:, :, ks], seen)
        keys = k_range[1] - k_range[0]
        magnitude = 2 * float(v.abs().max())  # as in the CPU kernel's comparison
        assert isinstance(got, torch.Tensor)
        assert_reordered_close(
            got, want, terms=attention_terms(keys), magnitude=magnitude, dtype=torch.float32
        )


def test_the_dense_kernel_and_causal_rows_take_their_paths():
    """Causality alone prepares no mask (SDPA's is_causal); 'dense' prepares the boolean
    (batch, 1, seq, seq) mask; one rule's mask is shared by the layers that use it."""
    doc_ids = doc_ids_of(DOC_LENGTHS)
    rules = [MaskRule(documents=True, window=8), MaskRule(documents=True), MaskRule()]
    masks = prepare_masks([*rules, rules[0]], doc_ids, 2, SEQ, torch.device("cpu"), "dense")
    assert masks[2] is None and masks[3] is masks[0]
    assert isinstance(masks[1], torch.Tensor) and masks[1].shape == (2, 1, SEQ, SEQ)
    q, k, v = (t.detach() for t in random_qkv(2, seq=SEQ))
    got = attend(q, k, v, masks[1])
    want = reference_attention(q, k, v, masks[1])
    magnitude = 2 * float(v.abs().max())
    assert_reordered_close(
        got, want, terms=attention_terms(SEQ), magnitude=magnitude, dtype=torch.float32
    )


def test_a_meta_forward_prepares_no_mask():
    """A shape-only forward (a pipeline's start-up) needs no mask and could build none."""
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    (mask,) = prepare_masks([MaskRule(documents=True)], ids, 1, 8, torch.device("meta"))
    assert mask is None


def test_unit_roundoff_scale_of_the_bounds():
    """The bounds above stay far below what a wrong mask moves: one key let in or kept out
    of a query's ~100 visible keys moves its output by about 1e-2 of max|v|."""
    bound = 2 * attention_terms(SEQ, backward=True) * unit_roundoff(torch.float32)
    assert bound < 1e-3


@pytest.mark.slow
def test_compiled_flex_attention_equals_the_reference_and_compiles_once_per_rule(caplog):
    """The compiled kernel (inductor; forward only on the CPU, whose flex has no backward):
    the same outputs as the reference, one compile for a rule and shape, said in the log,
    and none for the next batch's documents, whose ids the mask reads as data."""
    from torch._dynamo.utils import counters

    rule = MaskRule(documents=True, window=150)
    q, k, v = (t.detach() for t in random_qkv(2, seq=640))
    lengths = [[[300, 40, 300], [20, 620]], [[100, 540], [640]]]
    graphs = []
    with caplog.at_level("INFO", logger="kempnerforge.model.attention.kernels"):
        for batch in lengths:
            doc_ids = doc_ids_of(batch)
            got = attend(q, k, v, block_mask(rule, doc_ids, (0, 640), (0, 640)))
            want = reference_attention(q, k, v, dense_mask(rule, doc_ids, (0, 640), (0, 640)))
            magnitude = 2 * float(v.abs().max())  # as in the eager comparisons above
            terms = attention_terms(640)
            assert_reordered_close(got, want, terms=terms, magnitude=magnitude, dtype=torch.float32)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[0]
    compiling = [r for r in caplog.records if "compiling FlexAttention" in r.getMessage()]
    assert len(compiling) == 1 and "(2, 4, 640, 16)" in compiling[0].getMessage()
