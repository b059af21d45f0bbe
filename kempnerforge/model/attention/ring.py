"""Ring attention: context parallelism past the head count. Key/value blocks travel around
a ring of context-parallel ranks while each rank attends its own queries to every block
its rules let it see, merging the blocks exactly through their log-sum-exp.

Layout (sequence_split.held_spans): the sequence is cut into ``2 * ring`` chunks, ring
rank i holds chunks i and ``2 * ring - 1 - i``; under causal attention every ring rank
then attends about half of every other rank's block (the other half is in its future)
and its own block causally, so the ranks' work is even. With a Ulysses group inside each
ring rank (the hybrid) the heads are exchanged inside the group first and the ring runs
over the group's two chunks with its share of the heads.

Forward, on each rank, ``ring`` steps: at step t it holds the keys and values of ring rank
``i - t``, sends them on to ``i + 1`` and receives the next from ``i - 1`` while it attends
to them (point-to-point, overlapped with the compute), and folds the block's output into
its running output by log-sum-exp weights in fp32. Pairs of chunks a rule hides wholly
(the future, another document, past the window) are skipped: no mask, no compute.

Backward is a custom autograd function, not autograd through the forward, which would
keep every block it received alive until backward (the whole sequence's keys and values
on every rank). It keeps only this rank's q, k, v, output and log-sum-exp, and runs the
ring again: each rank recomputes its share of each block's gradients from the merged
output and log-sum-exp, keeps dq, and adds dk and dv into an accumulator that travels
with the block; after the last step one more hop brings every block's accumulator home.
Memory is O(sequence / cp) per rank: its saved tensors, and in flight the block it
attends and the next (double-buffered, so the pass hides behind the compute), one fp32
accumulator and dq. The cost is the forward's key/value passes again plus one pass of
fp32 gradients per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist

from kempnerforge.model.attention.ring_blocks import (
    Block,
    RingMask,
    attend,
    attend_backward,
)
from kempnerforge.model.attention.sequence_split import (
    SequenceSplit,
    exchanged_heads,
    heads_to_sequence,
    kv_sequence_to_heads,
    sequence_to_heads,
)
from kempnerforge.model.attention.sinks import apply_sinks, sink_weight, sinks_backward
from kempnerforge.model.eager import run_eagerly

_P = ParamSpec("_P")
_R = TypeVar("_R")
_KEYS_TAG, _GRADS_TAG = 1, 2
"""Point-to-point tags: the key/value blocks and the gradient accumulators that travel
with them may be in flight between the same two ranks at once."""


@run_eagerly  # the ring's point-to-point sends do not trace
def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: SequenceSplit,
    mask: RingMask,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of this rank's positions over the whole sequence through the ring, under
    the layer's mask rule.

    q (batch, s, heads, head_dim), k and v (batch, s, kv_heads, head_dim): this rank's
    positions of every sequence (held_spans), after RoPE. Returns (batch, s, heads,
    head_dim), this rank's rows of one process's attention output. ``mask`` is the layer's
    rule prepared for the ring (ring_blocks.py ring_masks: causality, and its packed
    documents and sliding window where it has them); every context-parallel rank calls
    this with the same one. ``sinks`` (heads,), if given, are the heads' sink logits:
    one more term of the merged log-sum-exp (sinks.py), applied once every block is in.
    """
    if split.ulysses > 1:  # the hybrid: whole heads of the ring rank's two chunks first
        q = sequence_to_heads(q, split)
        k, v = kv_sequence_to_heads(k, split), kv_sequence_to_heads(v, split)
        sinks = None if sinks is None else exchanged_heads(sinks, split)
    plan = RingPlan.of(split, q.shape[1], mask)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    out = _RingAttention.apply(qt, kt, vt, sinks, plan)
    out = out.transpose(1, 2)
    return heads_to_sequence(out, split) if split.ulysses > 1 else out


@dataclass(frozen=True)
class Call:
    """One kernel call of a ring step: query rows against key rows of the local block
    (positions 0..2c of the two chunks), and how they are masked."""

    rows: slice
    cols: slice
    block: Block
    chunks: tuple[int, int] | None = None
    """(query chunk, key chunk) in the sequence's 2 * ring chunks, for a MASKED call."""


@dataclass(frozen=True)
class RingPlan:
    """One rank's ring: its peers, its chunks and what each step computes."""

    group: dist.ProcessGroup
    prev: int
    """Global rank that sends this rank its blocks (ring rank i - 1, same Ulysses place)."""
    next: int
    """Global rank this rank sends its blocks to (ring rank i + 1)."""
    ring: int
    ring_rank: int
    chunk: int
    """Positions per chunk: half the local block."""
    mask: RingMask
    """The layer's rule and what it makes of each pair of chunks."""

    @classmethod
    def of(cls, split: SequenceSplit, local_len: int, mask: RingMask) -> RingPlan:
        """The plan of ``split``'s rank for a local block of ``local_len`` positions (its
        two chunks, after any head exchange)."""
        ring, u = split.ring, split.ulysses
        ring_rank, place = divmod(split.rank, u)

        def peer(step: int) -> int:
            return dist.get_global_rank(split.group, ((ring_rank + step) % ring) * u + place)

        return cls(
            group=split.group,
            prev=peer(-1),
            next=peer(1),
            ring=ring,
            ring_rank=ring_rank,
            chunk=local_len // 2,
            mask=mask,
        )

    def chunks_of(self, ring_rank: int) -> tuple[int, int]:
        """The two chunks ring rank ``ring_rank`` holds, in its order."""
        return ring_rank, 2 * self.ring - 1 - ring_rank

    def calls(self, step: int) -> list[Call]:
        """The kernel calls of ``step`` (the block of ring rank ``ring_rank - step``): each
        non-empty pair of chunks, the unmasked ones joined into one call where they share
        their rows or their columns."""
        mine, theirs = self.chunks_of(self.ring_rank), self.chunks_of(self.src(step))
        kinds = [[self.mask.kinds[q][k] for k in theirs] for q in mine]
        c = self.chunk
        half, whole = [slice(0, c), slice(c, 2 * c)], slice(0, 2 * c)
        full = Block.FULL
        if all(kind is full for row in kinds for kind in row):
            return [Call(whole, whole, full)]
        calls, done = [], set()
        for j in (0, 1):  # a key chunk every query sees
            if kinds[0][j] is full and kinds[1][j] is full:
                calls.append(Call(whole, half[j], full))
                done |= {(0, j), (1, j)}
        for i in (0, 1):  # a query chunk that sees every key
            if kinds[i][0] is full and kinds[i][1] is full and not done & {(i, 0), (i, 1)}:
                calls.append(Call(half[i], whole, full))
                done |= {(i, 0), (i, 1)}
        for i in (0, 1):
            for j in (0, 1):
                if (i, j) not in done and kinds[i][j] is not Block.EMPTY:
                    calls.append(Call(half[i], half[j], kinds[i][j], (mine[i], theirs[j])))
        return calls

    def src(self, step: int) -> int:
        """The ring rank whose block this rank holds at ``step``."""
        return (self.ring_rank - step) % self.ring

    def bias(
        self, call: Call, dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A MASKED call's additive mask (batch or 1, 1, c, c) in ``dtype`` and which of
        its query rows see any key at all (batch or 1, 1, c): the layer's rule over the
        call's pair of chunks (masks.py dense_mask)."""
        assert call.chunks is not None
        c, (q_chunk, k_chunk) = self.chunk, call.chunks
        q_range, k_range = (q_chunk * c, (q_chunk + 1) * c), (k_chunk * c, (k_chunk + 1) * c)
        return self.mask.bias(q_range, k_range, dtype, device)

    def pass_on(self, tensor: torch.Tensor, tag: int) -> _Pending:
        """Send ``tensor`` to the next ring rank and receive its like from the previous."""
        got = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, got, self.prev, self.group, tag),
        ]
        return _Pending(got, dist.batch_isend_irecv(ops))


@dataclass
class _Pending:
    """A pass in flight: ``wait`` gives the received tensor once both directions are done."""

    got: torch.Tensor
    requests: list[Any]

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.got


def _block(
    plan: RingPlan, call: Call, q: torch.Tensor, kv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call's (out, lse); rows that see no key get lse -inf and out 0."""
    q_rows, k, v = q[:, :, call.rows], kv[0][:, :, call.cols], kv[1][:, :, call.cols]
    if call.block is not Block.MASKED:
        return attend(q_rows, k, v, call.block, None)
    bias, seen = plan.bias(call, q.dtype, q.device)
    out, lse = attend(q_rows, k, v, call.block, bias)
    lse = lse.masked_fill(~seen, float("-inf"))
    return out.masked_fill(~seen[..., None], 0.0), lse


def _merge(
    out: torch.Tensor,
    lse: torch.Tensor,
    rows: slice,
    block_out: torch.Tensor,
    block_lse: torch.Tensor,
) -> None:
    """Fold a block's (out, lse) into the running fp32 ``out`` and ``lse`` at ``rows``:
    softmax over the union of the keys, as one softmax over all of them gives."""
    old_out, old_lse = out[:, :, rows], lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse.float())
    # Rows no block has reached yet stay -inf; subtracting 0 there keeps them at weight 0.
    base = new_lse.masked_fill(new_lse == float("-inf"), 0.0)
    old_out.mul_(torch.exp(old_lse - base)[..., None])
    old_out.add_(block_out.float() * torch.exp(block_lse.float() - base)[..., None])
    old_lse.copy_(new_lse)


def _ring_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RingPlan
) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged output (q's dtype) and log-sum-exp (fp32) of every block of the ring."""
    b, h, length, d = q.shape
    # Laid out (batch, L, heads, d): the caller's transpose back is then a view, and the
    # output projection's input shares its storage with what backward keeps.
    out = torch.zeros(b, length, h, d, dtype=torch.float32, device=q.device).transpose(1, 2)
    lse = torch.full((b, h, length), float("-inf"), dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    for step in range(plan.ring):
        incoming = plan.pass_on(kv, _KEYS_TAG) if step < plan.ring - 1 else None
        for call in plan.calls(step):
            _merge(out, lse, call.rows, *_block(plan, call, q, kv))
        if incoming is not None:
            kv = incoming.wait()
    return out.to(q.dtype), lse


def _ring_backward(
    dout: torch.Tensor,
    saved: tuple[torch.Tensor, ...],
    plan: RingPlan,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of this rank's q, k and v: dq from every block it saw; dk and dv
    summed over every rank whose queries saw its block, by the accumulator that travels
    around the ring with the block and comes home after the last step."""
    q, k, v, out, lse = saved
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = torch.stack([k, v])
    travelling: _Pending | None = None
    for step in range(plan.ring):
        incoming = plan.pass_on(kv, _KEYS_TAG) if step < plan.ring - 1 else None
        # This step's block's accumulator: a fresh one for the rank's own block, else the
        # one upstream sent at the end of its last step, as this rank ended its own (one
        # accumulator held, not two; only its transfer is not hidden behind compute).
        if travelling is None:
            grads = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)
        else:
            grads = travelling.wait()
        for call in plan.calls(step):
            bias = plan.bias(call, q.dtype, q.device)[0] if call.block is Block.MASKED else None
            rows, cols = call.rows, call.cols
            dq_part, dk_part, dv_part = attend_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                call.block,
                bias,
            )
            dq[:, :, rows] += dq_part
            grads[0][:, :, cols] += dk_part
            grads[1][:, :, cols] += dv_part
        travelling = plan.pass_on(grads, _GRADS_TAG)
        if incoming is not None:
            kv = incoming.wait()
    assert travelling is not None
    home = travelling.wait()
    return dq.to(q.dtype), home[0].to(k.dtype), home[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """q (batch, heads, L, d), k and v (batch, kv_heads, L, d) of this rank's two chunks ->
    its rows of the whole sequence's attention; backward through the ring again. With
    ``sinks`` the merged output is scaled by the sink weight, and backward runs the ring
    with the scaled gradient and the merged (sink-free) log-sum-exp (sinks.py)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sinks: torch.Tensor | None,
        plan: RingPlan,
    ) -> torch.Tensor:
        out, lse = _ring_forward(q, k, v, plan)
        weight = None
        if sinks is not None:
            weight = sink_weight(lse, sinks)
            out = apply_sinks(out, weight)
        ctx.save_for_backward(q, k, v, out, lse, weight)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, dout: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, None]:
        q, k, v, out, lse, weight = ctx.saved_tensors
        d_sinks = None
        if weight is not None:
            dout, d_sinks = sinks_backward(dout, out, weight)
        dq, dk, dv = _ring_backward(dout, (q, k, v, out, lse), ctx.plan)
        return dq, dk, dv, d_sinks, None
