"""The vocabulary-parallel head loss on real gloo ranks against the single-rank loss of whole
logits: loss, per-token losses and gradients, for a sequence-split and a replicated input."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kempnerforge.model.heads.head_loss import (
    IGNORE_INDEX,
    HeadLoss,
    HeadLossSpec,
    linear_cross_entropy,
    logits_head_loss,
)
from kempnerforge.model.heads.vocab_parallel_loss import head_loss, is_vocab_sharded, shard_rows
from tests.support.dist import run_distributed
from tests.support.parallel import whole
from tests.support.tolerance import assert_reordered_close, reorder_atol

pytestmark = pytest.mark.distributed

B, S, D, V = 2, 6, 8, 11  # 11 rows over 2 ranks: shards of 6 and 5
N = B * S
# Sharded and whole-logits losses sum in different orders: a logit sums D products, its
# logsumexp V terms (over the two shards' partial sums), the loss N tokens; the gradients
# add the logits' gradient summed over V (into hidden) or N (into the weight).
LOSS_TERMS = D + V + N
GRAD_TERMS = LOSS_TERMS + V + N


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, S, D, generator=gen)
    weight = torch.randn(V, D, generator=gen)
    labels = torch.randint(0, V, (B, S), generator=gen)
    labels[0, :2] = IGNORE_INDEX
    labels[1, 3] = V - 1  # a target in the last (short) shard
    return hidden, weight, labels


def _backward(loss: HeadLoss, hidden: torch.Tensor, weight: torch.Tensor) -> dict:
    """Run ``loss``'s backward; return the loss, the per-token losses and the gradients of
    ``hidden`` and ``weight`` (whole, also when the weight is a sharded DTensor)."""
    loss.loss_sum.backward()
    assert hidden.grad is not None and weight.grad is not None
    return {
        "loss": loss.loss_sum.detach(),
        "tokens": loss.token_losses,
        "grad_hidden": hidden.grad,
        "grad_weight": whole(weight.grad),
    }


def _reference(z_loss_weight: float) -> dict[str, torch.Tensor]:
    hidden, weight, labels = _inputs()
    hidden.requires_grad_()
    weight.requires_grad_()
    return _backward(logits_head_loss(hidden @ weight.t(), labels, z_loss_weight), hidden, weight)


def _vocab_parallel(rank: int, world_size: int, layout: str, spec: HeadLossSpec) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    hidden, weight, labels = _inputs()
    head = nn.Linear(D, V, bias=False)
    head.weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    assert is_vocab_sharded(head.weight)
    if layout == "sequence":
        first, count = shard_rows(S, world_size, rank)
        leaf = hidden[:, first : first + count].clone().requires_grad_()
        given: torch.Tensor = DTensor.from_local(leaf, mesh, [Shard(1)], run_check=False)
    else:
        leaf = hidden.clone().requires_grad_()
        given = leaf
    record = _backward(head_loss(given, head, labels, spec), leaf, head.weight)
    assert isinstance(head.weight.grad, DTensor)
    return record


@pytest.mark.parametrize("layout", ["sequence", "replicated"])
@pytest.mark.parametrize(("chunk_tokens", "z_loss_weight"), [(5, 1e-2), (0, 0.0)])
def test_the_vocabulary_parallel_loss_equals_the_loss_of_whole_logits(
    layout, chunk_tokens, z_loss_weight
) -> None:
    spec = HeadLossSpec(chunk_tokens, z_loss_weight)
    ranks = run_distributed(_vocab_parallel, 2, layout, spec)
    want = _reference(z_loss_weight)
    for rank, got in enumerate(ranks):
        # Every rank holds the whole loss, bit for bit the same as its peer's.
        assert torch.equal(got["loss"], ranks[0]["loss"])
        assert_reordered_close(got["loss"], want["loss"], terms=LOSS_TERMS)
        assert_reordered_close(got["tokens"], want["tokens"], terms=LOSS_TERMS)
        assert_reordered_close(got["grad_weight"], want["grad_weight"], terms=GRAD_TERMS)
        grad_hidden = want["grad_hidden"]
        if layout == "sequence":
            first, count = shard_rows(S, 2, rank)
            grad_hidden = grad_hidden[:, first : first + count]
        assert_reordered_close(got["grad_hidden"], grad_hidden, terms=GRAD_TERMS)


def _no_grad(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    hidden, weight, labels = _inputs()
    head = nn.Linear(D, V, bias=False)
    head.weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    with torch.no_grad():
        loss = head_loss(hidden, head, labels, HeadLossSpec(4, 0.0))
    return {"loss": loss.loss_sum, "grad_fn": loss.loss_sum.grad_fn is None}


def test_without_grad_the_vocabulary_parallel_loss_builds_no_graph() -> None:
    ranks = run_distributed(_no_grad, 2)
    want = _reference(0.0)
    for got in ranks:
        assert got["grad_fn"]
        assert_reordered_close(got["loss"], want["loss"], terms=LOSS_TERMS)


def test_shard_rows_split_as_dtensor_does() -> None:
    for rows, shards in [(11, 2), (10, 4), (5, 4), (256, 3)]:
        pieces = torch.arange(rows).chunk(shards)  # DTensor's Shard splits as chunk does
        for index in range(shards):
            first, count = shard_rows(rows, shards, index)
            piece = pieces[index] if index < len(pieces) else torch.empty(0)
            assert count == piece.numel()
            if count:
                assert first == int(piece[0])


BF16_TOL = {"rtol": 1e-2, "atol": 1e-2}  # a bf16 gradient within one rounding step


def _single_rank_bf16(mode: str) -> dict[str, torch.Tensor]:
    """The single-rank chunked loss in bf16 (``mode``: "autocast" over fp32 tensors, or
    "bf16" tensors), the reference the vocabulary-parallel loss must match in bf16."""
    hidden, weight, labels = _inputs()
    if mode == "bf16":
        hidden, weight = hidden.bfloat16(), weight.bfloat16()
    hidden.requires_grad_()
    weight.requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        loss = linear_cross_entropy(hidden, weight, labels, chunk_tokens=5, z_loss_weight=1e-2)
    return _backward(loss, hidden, weight)


def _vocab_parallel_bf16(rank: int, world_size: int, mode: str) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    hidden, weight, labels = _inputs()
    if mode == "bf16":
        hidden, weight = hidden.bfloat16(), weight.bfloat16()
    head = nn.Linear(D, V, bias=False, dtype=weight.dtype)
    head.weight = nn.Parameter(distribute_tensor(weight, mesh, [Shard(0)]))
    leaf = hidden.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast"):
        loss = head_loss(leaf, head, labels, HeadLossSpec(5, 1e-2))
    record = _backward(loss, leaf, head.weight)
    assert isinstance(head.weight.grad, DTensor)
    return record


@pytest.mark.parametrize("mode", ["autocast", "bf16"])
def test_in_bf16_the_vocabulary_parallel_loss_matches_the_single_rank_loss(mode) -> None:
    """Under bf16 autocast, and with bf16 weights, the sharded logits' softmax (fp32 over
    bf16 logits) gives the single-rank chunked loss's values and gradients, in their
    dtypes, within bf16 rounding; the loss stays fp32 and close to the fp32 loss."""
    ranks = run_distributed(_vocab_parallel_bf16, 2, mode)
    want = _single_rank_bf16(mode)
    fp32 = _reference(1e-2)["loss"]
    # The two kernels may sum a logit's D products in another order, and an fp32 sum near
    # a bf16 rounding midpoint then rounds to the neighbouring bf16 value: a logit moves by
    # up to one bf16 step. A token's loss moves by at most the sum of |softmax - onehot|
    # (2) plus the z-loss's 2 * 1e-2 * |logsumexp| (under 1) times that: 3 bf16 roundings
    # of the largest |logit| a token, N tokens for the loss; beside fp32 reordering.
    hidden, weight, _ = _inputs()
    logit = (hidden.abs() @ weight.abs().t()).max().item()
    loss_atol = reorder_atol(torch.bfloat16, 3 * N, logit)
    loss_atol += reorder_atol(torch.float32, LOSS_TERMS, want["loss"].abs().item())
    token_atol = reorder_atol(torch.bfloat16, 3, logit)
    token_atol += reorder_atol(torch.float32, LOSS_TERMS, want["tokens"].abs().max().item())
    for got in ranks:
        assert torch.equal(got["loss"], ranks[0]["loss"])
        assert got["loss"].dtype == torch.float32
        torch.testing.assert_close(got["loss"], want["loss"], atol=loss_atol, rtol=0)
        torch.testing.assert_close(got["loss"], fp32, rtol=2e-3, atol=0.0)
        torch.testing.assert_close(got["tokens"], want["tokens"], atol=token_atol, rtol=0)
        for name in ("grad_hidden", "grad_weight"):
            assert got[name].dtype == want[name].dtype, name
            torch.testing.assert_close(got[name], want[name], **BF16_TOL)
