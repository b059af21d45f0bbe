"""The output head fused with the cross-entropy: the loss and its gradients one token chunk at
a time, so a micro-batch's whole (tokens, vocab) logits never exist at once."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
"""Label of a position that has no target. The model layer cannot import data/, so the value
is repeated here; it must equal kempnerforge.data.dataset.IGNORE_INDEX (a test checks)."""


@dataclass(frozen=True)
class HeadLossSpec:
    """How Transformer.forward computes the loss when it is given labels."""

    chunk_tokens: int = 2048
    """Tokens per chunk of the fused head + cross-entropy; 0 or less: all tokens in one."""
    z_loss_weight: float = 0.0
    """Weight of logsumexp(logits)^2 per supervised token; 0 disables the z-loss."""


class HeadLoss(NamedTuple):
    """A micro-batch's summed loss and its per-token breakdown."""

    loss_sum: torch.Tensor
    """Cross-entropy plus z-loss summed over supervised tokens: 0-d fp32, differentiable."""
    token_losses: torch.Tensor
    """The same objective per position, shaped like the labels, 0 where the label is
    ignored; detached (for metrics only) unless asked for with their graph
    (logits_head_loss's ``per_token_grad``)."""


def z_loss_terms(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """logsumexp(logits)^2 per position, zero where the label is ignored."""
    log_z = torch.logsumexp(logits.float(), dim=-1)
    return log_z.square() * (labels != IGNORE_INDEX)


def token_losses(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float = 0.0
) -> torch.Tensor:
    """The training objective per position, shaped like ``labels`` (0 where ignored).

    Cross-entropy plus ``z_loss_weight`` times the z-loss term, in fp32 and differentiable:
    summed, it is what training.loss.build_loss_fn returns for the same weight.
    """
    logits = logits.float()  # one fp32 copy serves the cross-entropy and the z-loss
    per_token = F.cross_entropy(
        logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    ).view(labels.shape)
    if z_loss_weight:
        per_token = per_token + z_loss_weight * z_loss_terms(logits, labels)
    return per_token


def logits_head_loss(
    logits: torch.Tensor, labels: torch.Tensor, z_loss_weight: float, per_token_grad: bool = False
) -> HeadLoss:
    """HeadLoss from whole logits: one per-token cross-entropy whose sum is the loss; with
    ``per_token_grad`` the per-token losses keep their graph too (an objective that weighs
    them), else they are detached."""
    per_token = token_losses(logits, labels, z_loss_weight)
    return HeadLoss(per_token.sum(), per_token if per_token_grad else per_token.detach())


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_tokens: int,
    z_loss_weight: float,
) -> HeadLoss:
    """Cross-entropy (plus z-loss) of the logits ``hidden @ weight.T`` against ``labels``.

    Equal to logits_head_loss on the whole logits, but the tokens are walked in chunks of
    ``chunk_tokens`` (0 or less: one chunk): each chunk's logits, loss and, when autograd
    needs them, the gradients w.r.t. ``hidden`` and ``weight`` are computed and the logits
    dropped. Backward only scales the stored gradients, nothing is recomputed. Under
    autocast the matmuls run in the autocast dtype and the softmax in fp32; the gradient
    w.r.t. ``weight`` is accumulated in fp32 over the chunks. ``hidden`` is (..., dim),
    ``weight`` (vocab, dim) and ``labels`` hidden's shape without the last dimension.
    """
    chunk_loss = functools.partial(_chunk_loss, z_loss_weight=z_loss_weight)
    return chunked_head_loss(hidden, weight, labels, chunk_tokens, chunk_loss)


ChunkLoss = Callable[[torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]]
"""(one chunk's logits, its targets, whether gradients are needed) -> (per-token losses,
d(their sum)/d(the logits) or None); it may overwrite the logits."""


def chunked_head_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    chunk_loss: ChunkLoss,
) -> HeadLoss:
    """The loss of ``hidden @ weight.T`` against ``labels``, chunk by chunk, with
    ``chunk_loss`` computing each chunk's losses and logit gradients (this module's on the
    whole vocabulary; model/heads/vocab_parallel_loss.py's on a vocabulary shard). Without
    autograd needs, no graph and no gradients, and the head runs on the positions whose
    label is not IGNORE_INDEX only (the same on every tensor-parallel rank, whose labels
    are the same)."""
    dtype = compute_dtype(hidden, weight)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        loss_sum, per_token = _ChunkedHeadLoss.apply(
            hidden, weight, labels, chunk_tokens, chunk_loss, dtype
        )
        return HeadLoss(loss_sum, per_token)
    scored = labels != IGNORE_INDEX
    with no_autocast(hidden.device.type):
        if bool(scored.all()):
            loss_sum, per_token, _, _ = _chunked(
                hidden, weight, labels, chunk_tokens, chunk_loss, dtype, (False, False)
            )
            return HeadLoss(loss_sum, per_token)
        # Without gradients an ignored position's loss is 0 and nothing else needs its
        # logits: the head runs on the scored positions only (an eval task scores a few
        # tokens of each window).
        loss_sum, kept, _, _ = _chunked(
            hidden[scored], weight, labels[scored], chunk_tokens, chunk_loss, dtype, (False, False)
        )
    per_token = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
    per_token[scored] = kept
    return HeadLoss(loss_sum, per_token)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype nn.Linear would use here: the autocast dtype when autocast is on."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    # The dtypes are chosen explicitly below; autocast would cast the fp32 softmax math.
    return torch.autocast(device_type, enabled=False)


class _ChunkedHeadLoss(torch.autograd.Function):
    """Forward computes loss and gradients chunk by chunk; backward scales the gradients."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
        chunk_loss: ChunkLoss,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        needs = (bool(ctx.needs_input_grad[0]), bool(ctx.needs_input_grad[1]))
        with no_autocast(hidden.device.type):
            loss_sum, per_token, grad_hidden, grad_weight = _chunked(
                hidden, weight, labels, chunk_tokens, chunk_loss, dtype, needs
            )
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(per_token)
        return loss_sum, per_token

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor, _grad_tokens: Any) -> tuple[Any, ...]:
        grad_hidden, grad_weight = ctx.saved_tensors
        # Out of place: the stored gradients must survive a backward with retain_graph.
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * grad_loss).to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_tokens: int,
    chunk_loss: ChunkLoss,
    dtype: torch.dtype,
    needs: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(loss sum, per-token losses, grad of hidden or None, grad of weight or None).

    The gradients are those of the loss sum; grad of hidden has hidden's shape and dtype,
    grad of weight is fp32. Autocast must be off: every dtype here is explicit.
    """
    flat = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    num_tokens = flat.shape[0]
    step = chunk_tokens if chunk_tokens > 0 else max(num_tokens, 1)
    h = flat.to(dtype)
    w = weight.to(dtype)
    loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
    per_token = torch.empty(num_tokens, dtype=torch.float32, device=hidden.device)
    grad_hidden: torch.Tensor | None = None
    grad_weight: torch.Tensor | None = None
    if needs[0]:
        grad_hidden = torch.empty(flat.shape, dtype=flat.dtype, device=flat.device)
    if needs[1]:
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, num_tokens, step):
        end = min(start + step, num_tokens)
        h_chunk = h[start:end]
        losses, dlogits = chunk_loss(h_chunk @ w.t(), targets[start:end], any(needs))
        per_token[start:end] = losses
        loss_sum += losses.sum()
        if dlogits is None:
            continue
        dlogits = dlogits.to(dtype)
        if grad_hidden is not None:
            grad_hidden[start:end] = dlogits @ w
        if grad_weight is not None and dtype == torch.float32:
            grad_weight.addmm_(dlogits.t(), h_chunk)
        elif grad_weight is not None:
            grad_weight += dlogits.t() @ h_chunk  # the chunk's product, summed in fp32
    if grad_hidden is not None:
        grad_hidden = grad_hidden.view(hidden.shape)
    return loss_sum, per_token.view(labels.shape), grad_hidden, grad_weight


def _chunk_loss(
    logits: torch.Tensor, targets: torch.Tensor, with_grad: bool, *, z_loss_weight: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token losses of one chunk's logits (chunk, vocab), and d(their sum)/d(logits).

    The gradient is softmax * (1 + 2 * z * logsumexp) minus the one-hot target, zero on
    ignored rows. The exponentials, then the gradient, are written over the fp32 logits,
    so a chunk holds one (chunk, vocab) fp32 buffer (torch.logsumexp would allocate a
    second one).
    """
    logits = logits.float()
    supervised = targets != IGNORE_INDEX
    safe = torch.where(supervised, targets, 0).unsqueeze(1)
    target_logits = logits.gather(1, safe).squeeze(1)
    peak = logits.amax(dim=1)
    peak = torch.where(peak.isinf(), 0.0, peak)  # as torch.logsumexp: no inf - inf
    exp = logits.sub_(peak.unsqueeze(1)).exp_()
    targets_held = (safe, supervised)
    return softmax_losses(
        exp, peak, exp.sum(dim=1), target_logits, supervised, targets_held, z_loss_weight, with_grad
    )


def softmax_losses(
    exp: torch.Tensor,
    peak: torch.Tensor,
    total: torch.Tensor,
    target_logits: torch.Tensor,
    supervised: torch.Tensor,
    targets_held: tuple[torch.Tensor, torch.Tensor],
    z_loss_weight: float,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token losses (cross-entropy plus z-loss, 0 on ignored rows) of a chunk whose
    rows' log-sum-exp is ``peak + log(total)``, and, with ``with_grad``, their gradient
    w.r.t. the logits written over ``exp`` (exp(logits - peak) for the columns this rank
    holds): softmax * (1 + 2 * z * logsumexp) minus the one-hot target, zero on ignored
    rows. ``targets_held`` is (each row's target column among these columns as an (n, 1)
    index, whether the row's target is among them)."""
    lse = peak + total.log()
    losses = lse - target_logits
    if z_loss_weight:
        losses = losses + z_loss_weight * lse.square()
    losses = torch.where(supervised, losses, 0.0)
    if not with_grad:
        return losses, None
    scale = supervised / total  # softmax = exp / total; ignored rows get no gradient
    if z_loss_weight:
        scale = scale * (1.0 + (2.0 * z_loss_weight) * lse)
    probs = exp.mul_(scale.unsqueeze(1))
    column, held = targets_held
    probs.scatter_add_(1, column, -held.to(probs.dtype).unsqueeze(1))
    return losses, probs
