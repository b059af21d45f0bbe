"""Ring attention's pieces in one process: which chunk pairs a layer's mask rule (masks.py)
hides wholly (skipped), leaves whole or masks by causality alone, the masked pairs' masks
against the rule's dense mask, the zigzag's even work, and the block kernels (the CPU's
fused one and the math one other devices run) against one softmax in float64."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.model import ModelConfig
from kempnerforge.distributed.parallelize import ParallelPlan, parallelize_model
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.attention import MaskRule, dense_mask, prepare_masks, visible
from kempnerforge.model.attention.ring import Call, RingPlan, _merge
from kempnerforge.model.attention.ring_blocks import (
    Block,
    RingMask,
    attend,
    attend_backward,
    math_attend,
    math_attend_backward,
    ring_masks,
)
from kempnerforge.model.transformer import Transformer
from tests.support.tolerance import assert_reordered_close


def _ring_mask(seq: int, ring: int, window: int = 0, ids=None) -> RingMask:
    rule = MaskRule(documents=ids is not None, window=window)
    (mask,) = ring_masks([rule], ids, seq, ring)
    return mask


@pytest.mark.parametrize(
    ("q", "k", "window", "block"),
    [
        (2, 3, 0, Block.EMPTY),  # every key in the future
        (2, 0, 0, Block.FULL),
        (2, 2, 0, Block.CAUSAL),
        (2, 0, 5, Block.EMPTY),  # positions 8..11 against 0..3: every key 5 or more back
        (2, 1, 8, Block.FULL),  # the farthest pair is 7 back
        (2, 1, 6, Block.MASKED),
        (2, 2, 4, Block.CAUSAL),
        (2, 2, 3, Block.MASKED),
    ],
)
def test_positions_alone_decide_some_pairs_of_chunks(q, k, window, block):
    """16 positions in 4 chunks of 4 (a ring of 2): the rule's verdict on query chunk q
    against key chunk k is the rule's own, position by position."""
    assert _ring_mask(16, 2, window).kinds[q][k] is block
    pos = torch.arange(16)
    rule = MaskRule(window=window)
    seen = visible(rule, pos[4 * q : 4 * q + 4, None], pos[None, 4 * k : 4 * k + 4])
    if block is Block.EMPTY:
        assert not seen.any()
    if block is Block.FULL:
        assert seen.all()
    if block is Block.CAUSAL:
        assert torch.equal(seen, torch.ones_like(seen).tril())
    if block is Block.MASKED:
        assert seen.any() and not torch.equal(seen, torch.ones_like(seen).tril())


def test_documents_tell_the_pairs_no_query_can_see():
    """Two rows of 4 chunks of 4: where no row's ids meet, the pair is skipped; where
    every row is one document on both sides, the documents add no mask."""
    ids = torch.tensor(
        [
            [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 2, 2, 3, 3, 3, 3],
            [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1],
        ]
    )
    mask = _ring_mask(16, 2, ids=ids)
    assert mask.kinds[1][0] is Block.FULL  # document 0 on both sides in both rows
    assert mask.kinds[1][1] is Block.CAUSAL  # one document, causality alone
    assert mask.kinds[3][0] is Block.EMPTY  # documents 3 and 1 against document 0
    assert mask.kinds[3][1] is Block.EMPTY
    assert mask.kinds[2][1] is Block.MASKED  # row 1: chunk 2 starts in document 0
    assert mask.kinds[3][2] is Block.MASKED  # row 1: document 1 on both sides
    assert mask.kinds[0][3] is Block.EMPTY  # the future, whatever the documents


def test_a_masked_pair_masks_with_the_rules_dense_mask():
    """A MASKED call's additive mask is 0 where the rule's dense mask (masks.py) shows the
    key and -inf where it hides it, and its rows that see nothing are reported."""
    ids = torch.tensor([[0] * 6 + [1] * 10, [0] * 9 + [1] * 7])
    mask = _ring_mask(16, 2, window=3, ids=ids)
    plan = _plan(2, 1, 4, mask)  # chunks 1 and 2
    want = dense_mask(mask.rule, ids, (8, 12), (4, 8))
    assert mask.kinds[2][1] is Block.MASKED
    call = Call(slice(4, 8), slice(0, 4), Block.MASKED, (2, 1))
    bias, seen = plan.bias(call, torch.float32, torch.device("cpu"))
    assert torch.equal(bias == 0, want) and torch.equal(bias.isinf(), ~want)
    assert torch.equal(seen, want.any(-1))


def test_each_layer_gets_its_own_rule_and_equal_rules_share_one_mask():
    """prepare_masks with a ring: a RingMask per layer, one per distinct rule; a window
    layer skips the pairs past its window, a full layer does not."""
    ids = torch.zeros(1, 32, dtype=torch.long)
    rules = [MaskRule(True, 4), MaskRule(True, 0), MaskRule(True, 4)]
    masks = prepare_masks(rules, ids, 1, 32, torch.device("cpu"), ring=4)
    assert all(isinstance(m, RingMask) for m in masks)
    assert masks[0] is masks[2] and masks[0] is not masks[1]
    assert isinstance(masks[0], RingMask) and isinstance(masks[1], RingMask)
    assert masks[0].kinds[7][0] is Block.EMPTY and masks[1].kinds[7][0] is Block.FULL


def _plan(ring: int, ring_rank: int, chunk: int, mask: RingMask | None = None) -> RingPlan:
    mask = mask if mask is not None else _ring_mask(2 * ring * chunk, ring)
    # The plan's group and peers are only read when it passes blocks on.
    return RingPlan(None, 0, 0, ring, ring_rank, chunk, mask)  # type: ignore[arg-type]


def _work(plan: RingPlan) -> int:
    """Query-key pairs the plan's kernel calls cover over the whole ring."""
    total = 0
    for step in range(plan.ring):
        for call in plan.calls(step):
            total += (call.rows.stop - call.rows.start) * (call.cols.stop - call.cols.start)
    return total


@pytest.mark.parametrize("ring", [2, 4])
def test_zigzag_chunks_give_every_ring_rank_the_same_causal_work(ring):
    """Causal attention: each rank computes its own block (3 calls: two causal chunk
    pairs and the late chunk against the early one) and half of every other block (one
    call): the same pairs of positions on every rank, a quarter of the rank's block per
    step more than the causal half."""
    chunk = 4
    works = []
    for rank in range(ring):
        plan = _plan(ring, rank, chunk)
        kinds = [call.block for call in plan.calls(0)]
        assert sorted(k.value for k in kinds) == ["causal", "causal", "full"]
        for step in range(1, ring):
            (call,) = plan.calls(step)
            assert call.block is Block.FULL
        works.append(_work(plan))
    assert len(set(works)) == 1
    own = 2 * chunk * chunk + chunk * chunk  # two causal pairs (done whole) and one full
    assert works[0] == own + (ring - 1) * 2 * chunk * chunk


def test_pairs_a_rule_hides_wholly_are_not_computed():
    """One document per chunk: no rank computes anything of another's block. A window of
    one chunk: a rank sees only the chunks next to its own."""
    ring, chunk = 4, 4
    ids = torch.arange(2 * ring).repeat_interleave(chunk)[None]
    for rank in range(ring):
        plan = _plan(ring, rank, chunk, _ring_mask(2 * ring * chunk, ring, ids=ids))
        assert all(plan.calls(step) == [] for step in range(1, ring))
    windowed = _plan(ring, 1, chunk, _ring_mask(2 * ring * chunk, ring, window=chunk))
    visited = {plan_step for plan_step in range(ring) if windowed.calls(plan_step)}
    # Chunks 1 and 6: its own block, and the blocks holding chunks 0 (ring rank 0) and 5
    # (ring rank 2).
    assert visited == {0, 1, 3}


def _reference(q, k, v, mask):
    """One softmax over every key, in float64: (out, lse) with q (b, h, L, d)."""
    n_rep = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(n_rep, 1) for t in (k, v))
    scores = q.double() @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask, -math.inf)
    return torch.softmax(scores, -1) @ vd, torch.logsumexp(scores, -1)


def _terms(q, k, mask) -> int:
    """The sums along the longest chain of one block's attention and its merge: the
    scores' dot products (head_dim terms, whose rounding the exponential turns into a
    relative error of each weight scaled by the largest |score|), the softmax's
    normaliser and the weighted values (the keys each), the two blocks' merge (a
    log-sum-exp and a rescaling); backward runs the chain again, then sums over the
    queries for the key and value gradients (their rows)."""
    scores = q.double() @ k.double().repeat_interleave(q.shape[1] // k.shape[1], 1).mT
    biggest = float(scores.abs().max()) / math.sqrt(q.shape[-1])
    forward = math.ceil(q.shape[-1] * max(1.0, biggest)) + 2 * k.shape[2] + 4
    return 2 * forward + q.shape[2]


@pytest.mark.parametrize("kernel", ["fused", "math"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("masking", ["causal", "documents"])
def test_two_merged_key_blocks_and_their_backward_give_one_softmax(kernel, kv_heads, masking):
    """Keys in two blocks, each attended with its own kernel call and merged by their
    log-sum-exps in fp32, give one softmax's output over all of them; each block's
    backward from the merged output and log-sum-exp gives its exact share of the
    gradients. Rows that see no key of a block (a new document) must not disturb the
    merge."""
    _two_merged_blocks(kernel, kv_heads, masking, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("masking", ["causal", "documents"])
def test_the_blocks_on_a_gpu_give_one_softmax(masking):
    """On a GPU attend dispatches to the math kernel: the same comparison on CUDA tensors."""
    _two_merged_blocks("dispatch", 2, masking, torch.device("cuda"))


def _two_merged_blocks(kernel: str, kv_heads: int, masking: str, device: torch.device) -> None:
    torch.manual_seed(0)
    b, h, length, d = 2, 4, 24, 8
    q = torch.randn(b, h, length, d)
    k, v = torch.randn(b, kv_heads, length, d), torch.randn(b, kv_heads, length, d)
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 21])
    rule = MaskRule(documents=masking == "documents")
    mask = dense_mask(rule, ids if rule.documents else None, (0, length), (0, length))
    want_out, want_lse = _reference(q, k, v, mask)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    grad = torch.randn(b, h, length, d)
    F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, enable_gqa=True).backward(
        grad.double()
    )

    q, k, v, grad, mask = (t.to(device) for t in (q, k, v, grad, mask))
    out = torch.zeros(b, h, length, d, device=device)
    lse = torch.full((b, h, length), -math.inf, device=device)
    halves = [slice(0, length // 2), slice(length // 2, length)]
    biases = []
    for cols in halves:
        seen = mask[..., cols].expand(b, 1, length, length // 2)
        bias = torch.zeros(seen.shape, device=device).masked_fill(~seen, -math.inf)
        biases.append(bias)
        if kernel in ("fused", "dispatch"):
            part_out, part_lse = attend(q, k[:, :, cols], v[:, :, cols], Block.MASKED, bias)
        else:
            part_out, part_lse = math_attend(q, k[:, :, cols], v[:, :, cols], False, bias)
        part_lse = part_lse.masked_fill(~seen.any(-1), -math.inf)
        _merge(
            out, lse, slice(0, length), part_out.masked_fill(~seen.any(-1)[..., None], 0), part_lse
        )
    terms = _terms(q, k, mask)
    assert_reordered_close(out.cpu(), want_out.float(), terms=terms, dtype=torch.float32)
    assert_reordered_close(lse.cpu(), want_lse.float(), terms=terms, dtype=torch.float32)

    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for cols, bias in zip(halves, biases, strict=True):
        args = (grad, q, k[:, :, cols], v[:, :, cols], out, lse)
        if kernel in ("fused", "dispatch"):
            parts = attend_backward(*args, Block.MASKED, bias)
        else:
            parts = math_attend_backward(*args, False, bias)
        dq += parts[0]
        dk[:, :, cols] += parts[1]
        dv[:, :, cols] += parts[2]
    for got, want in ((dq, qd), (dk, kd), (dv, vd)):
        assert_reordered_close(got.cpu(), want.grad.float(), terms=terms, dtype=torch.float32)


@pytest.mark.parametrize("kernel", ["fused", "math"])
def test_the_causal_flag_is_one_causal_softmax(kernel):
    """A causal block (the same positions both sides) with the kernel's own causal mask."""
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    want, want_lse = _reference(q, k, v, dense_mask(MaskRule(), None, (0, 16), (0, 16)))
    if kernel == "fused":
        out, lse = attend(q, k, v, Block.CAUSAL, None)
    else:
        out, lse = math_attend(q, k, v, True, None)
    terms = _terms(q, k, torch.ones(1, dtype=torch.bool))
    assert_reordered_close(out, want.float(), terms=terms, dtype=torch.float32)
    assert_reordered_close(lse, want_lse.float(), terms=terms, dtype=torch.float32)


def test_the_dense_kernel_under_a_ring_is_set_and_said_to_do_nothing_to_the_ring(caplog):
    """train.attention_kernel reaches the model (the whole-sequence sample reads it), and
    under a ring, whose block kernels apply every rule, 'dense' warns that the ring
    ignores it; 'auto' says nothing."""
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, vocab_size=64, max_seq_len=32)
    for kernel, warned in (("dense", True), ("auto", False)):
        caplog.clear()
        model = Transformer(cfg)
        with caplog.at_level("WARNING", logger="kempnerforge.distributed.parallelize"):
            plan = ParallelPlan(attention_kernel=kernel)
            parallelize_model(model, RuntimeContext(cp_ring=2), plan)
        assert model.attention_kernel == kernel
        said = [r.getMessage() for r in caplog.records if "ring attention" in r.getMessage()]
        assert len(said) == warned
        if warned:
            assert said[0].startswith("train.attention_kernel = 'dense' does nothing")
