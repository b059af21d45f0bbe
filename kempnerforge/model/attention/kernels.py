"""Attention under a layer's mask rule, by the kernel the rule's mask was prepared for.

Per batch, prepare_masks turns each distinct rule of the layers into one mask shared by
the layers that use it: None for causality alone (SDPA's is_causal kernels, no mask), a
FlexAttention BlockMask on a GPU, the CPU's Segments (flex has no CPU backward in this
PyTorch), or with ``kernel="dense"`` a boolean (batch, 1, seq, seq) tensor. attend runs
q, k and v through the kernel the mask's form names. Under ring attention every rule,
causal included, becomes a RingMask (ring_blocks.py), which ring.py applies itself.
A model with attention sinks (sinks.py) needs each row's log-sum-exp, which SDPA's
causal kernels do not give: its masks are prepared with ``lse``, so causality alone is
a block mask or Segments too.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from kempnerforge.core.logging import get_logger
from kempnerforge.model.attention.masks import MaskRule, block_mask, dense_mask
from kempnerforge.model.attention.ring_blocks import RingMask, ring_masks
from kempnerforge.model.attention.segments import Segments, plan_segments, segments_attention
from kempnerforge.model.attention.sinks import apply_sinks, dense_sink_attention, sink_weight

logger = get_logger(__name__)

MAX_COMPILED_SHAPES = 8
"""Distinct (shape, rule) pairs compiled for FlexAttention in one process (torch's own
recompile limit); later ones run eagerly, said once. A training run needs one or two."""

LayerMask = torch.Tensor | BlockMask | Segments | RingMask | None
"""A layer's prepared mask: None (causal only), dense, a block mask, segments, or the
rule as ring attention applies it."""
PreparedMask = torch.Tensor | BlockMask | Segments | None
"""A mask one process's kernels apply (every LayerMask but the ring's)."""


def set_attention_kernel(model: nn.Module, kernel: str) -> None:
    """Make every module of ``model`` that prepares masks (a Transformer, a decoder inside
    a larger model) prepare them for ``kernel`` (train.attention_kernel)."""
    for module in model.modules():
        if hasattr(module, "attention_kernel"):
            # setattr: nn.Module.__setattr__ is typed for tensors and modules only.
            setattr(module, "attention_kernel", kernel)  # noqa: B010


def prepare_masks(
    rules: Sequence[MaskRule],
    doc_ids: torch.Tensor | None,
    batch: int,
    seq_len: int,
    device: torch.device,
    kernel: str = "auto",
    ring: int = 1,
    *,
    lse: bool = False,
) -> list[LayerMask]:
    """One prepared mask per rule in ``rules`` (a layer's each), built once per distinct
    rule and shared; ``doc_ids`` (batch, seq_len) covers the whole sequence when a rule
    separates documents. On the meta device (a shape-only forward) every mask is None.
    With ``ring`` > 1 (ring attention's ranks) each is a RingMask over 2 * ring chunks of
    the sequence, whatever ``kernel`` says: the ring runs its own block kernels. With
    ``lse`` (attention sinks) causality alone is prepared like any rule, for a kernel
    that yields the log-sum-exp, instead of None (SDPA's causal kernels)."""
    if ring > 1 and device.type != "meta":
        return list(ring_masks(rules, doc_ids, seq_len, ring))
    prepared: dict[MaskRule, LayerMask] = {}
    masks = []
    for rule in rules:
        if rule not in prepared:
            prepared[rule] = _prepare(rule, doc_ids, batch, seq_len, device, kernel, lse)
        masks.append(prepared[rule])
    return masks


def _prepare(
    rule: MaskRule,
    doc_ids: torch.Tensor | None,
    batch: int,
    seq_len: int,
    device: torch.device,
    kernel: str,
    lse: bool = False,
) -> PreparedMask:
    if (rule.is_causal and not lse) or device.type == "meta":
        return None
    whole = (0, seq_len)
    if device.type == "cuda" and kernel == "auto":
        return block_mask(rule, doc_ids, whole, whole, device=device)
    if device.type == "cpu" and kernel == "auto":
        return plan_segments(rule, doc_ids, batch, seq_len)
    # 'dense', or a device with neither (FlexAttention's backward is CUDA's alone).
    return dense_mask(rule, doc_ids, whole, whole, device)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: LayerMask,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q (batch, heads, seq, head_dim) over k and v (batch, kv_heads, seq,
    head_dim; kv_heads divides heads) under ``mask``; (batch, heads, seq, head_dim).
    ``sinks`` (heads,), if given, are the heads' sink logits (sinks.py).

    Segments inside a traced (compiled) block become the dense mask: their pieces are
    data the trace cannot follow, and the CPU has no compiled kernel with a backward.
    """
    assert not isinstance(mask, RingMask), "ring attention applies a RingMask (ring.py)"
    grouped = q.shape[1] != k.shape[1]
    if mask is None and sinks is not None:
        mask = _causal_with_lse(q)
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    if isinstance(mask, Segments):
        if not torch.compiler.is_compiling():
            return segments_attention(q, k, v, mask, sinks)
        mask = mask.dense().to(q.device)
    if isinstance(mask, BlockMask):
        return _FLEX(q, k, v, mask, sinks)
    if sinks is not None:
        return dense_sink_attention(q, k, v, sinks, mask)
    return _dense(q, k, v, mask)


def _causal_with_lse(q: torch.Tensor) -> PreparedMask:
    """Causality alone for a kernel that yields the log-sum-exp (sinks), where the caller
    prepared no mask: Segments on a CPU, a block mask on a GPU; on the meta device (a
    shape-only forward) the dense mask."""
    batch, _, seq_len, _ = q.shape
    if q.device.type == "meta":
        return torch.ones(1, 1, seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
    return _prepare(MaskRule(), None, batch, seq_len, q.device, "auto", lse=True)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA with a boolean mask. The CPU's flash kernel takes the mask and grouped heads as
    they are; on a GPU the key/value heads are repeated first, because the kernels that
    take a mask there (memory-efficient, cuDNN) do not accept grouped heads, and a silent
    fall-back to the math kernel would materialize every (seq, seq) score matrix."""
    n_rep = q.shape[1] // k.shape[1]
    if q.device.type == "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=n_rep > 1)
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _compile_unavailable(device: torch.device) -> str | None:
    """Why FlexAttention cannot be compiled here, or None when it can (a compile that
    fails anyway is caught at its first call)."""
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None


class _CompiledFlex:
    """FlexAttention compiled once per (shape, rule) and reused; eager, said once, where
    torch.compile is unavailable, fails, or past MAX_COMPILED_SHAPES."""

    def __init__(self) -> None:
        self.compiled = None
        self.keys: set = set()
        self.eager_reason: str | None = None
        self.said: set[str] = set()

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: BlockMask,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        grouped = q.shape[1] != k.shape[1]
        if torch.compiler.is_compiling():  # inside a compiled block: traced with it
            return _flex(flex_attention, q, k, v, mask, grouped, sinks)
        rule = getattr(mask.mask_mod, "rule", None)
        key = (*q.shape, *k.shape, q.dtype, q.device, rule, sinks is not None)
        reason = self.eager_reason or _compile_unavailable(q.device)
        if reason is None and key not in self.keys and len(self.keys) >= MAX_COMPILED_SHAPES:
            reason = f"more than {MAX_COMPILED_SHAPES} shapes and rules compiled already"
        if reason is not None:
            self._say_once(reason)
            return _flex(flex_attention, q, k, v, mask, grouped, sinks)
        if self.compiled is None:
            self.compiled = torch.compile(flex_attention, dynamic=False)
        if key in self.keys:
            return _flex(self.compiled, q, k, v, mask, grouped, sinks)
        return self._compile_call(key, q, k, v, mask, grouped, sinks)

    def _compile_call(
        self, key, q, k, v, mask: BlockMask, grouped: bool, sinks: torch.Tensor | None
    ) -> torch.Tensor:
        logger.info(
            "attention: compiling FlexAttention for queries %s, keys %s, %s (once per shape "
            "and mask rule; later calls reuse it)",
            tuple(q.shape),
            tuple(k.shape),
            str(q.dtype).removeprefix("torch."),
        )
        started = time.perf_counter()
        try:
            out = _flex(self.compiled, q, k, v, mask, grouped, sinks)
        except Exception as error:  # an inductor or Triton failure: eager from now on
            self.eager_reason = f"compiling it failed ({type(error).__name__}: {error})"
            self._say_once(self.eager_reason)
            return _flex(flex_attention, q, k, v, mask, grouped, sinks)
        self.keys.add(key)
        logger.info(
            "attention: FlexAttention's forward compiled in %.1f s (its backward compiles in "
            "the first backward)",
            time.perf_counter() - started,
        )
        return out

    def _say_once(self, reason: str) -> None:
        if reason not in self.said:
            self.said.add(reason)
            logger.warning(
                "attention: FlexAttention runs eagerly (%s): each layer then holds its "
                "(seq, seq) scores",
                reason,
            )


def _flex(fn, q, k, v, mask: BlockMask, grouped: bool, sinks=None) -> torch.Tensor:
    """FlexAttention's output; with ``sinks`` it also returns the log-sum-exp (natural
    log, differentiable), and the output is scaled by the sink weight through autograd,
    which is the sink model's function and so its exact gradient."""
    if sinks is None:
        out = fn(q, k, v, block_mask=mask, enable_gqa=grouped)
        assert isinstance(out, torch.Tensor)
        return out
    out, aux = fn(q, k, v, block_mask=mask, enable_gqa=grouped, return_aux=AuxRequest(lse=True))
    return apply_sinks(out, sink_weight(aux.lse, sinks))


_FLEX = _CompiledFlex()
"""The process's compiled FlexAttention (its compiled kernels are per process anyway)."""
