"""Multi-token prediction (DeepSeek-V3's MTP, arXiv 2412.19437 section 2.2): a training-only
head of model.mtp_depth modules after the decoder, each predicting one token further ahead.

Module k (1-based) at position i combines the previous hidden state h^{k-1}_i with the
embedding of token t_{i+k}:

    h'_i = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h^{k-1}_i)])     (embedding first)
    h^k  = norm(block(h'))                                        (a decoder block)
    P^k  = softmax(head(h^k))                                     (predicts t_{i+k+1})

h^0 is the decoder's output after its final norm, the hidden state its own head reads, and
each h^k the module's output after its head norm (shared_head.norm): the report calls h^0
"the representation given by the main model", and transformers' MtpModel (which computes
the published DeepSeek-V3 and GLM-4-MoE MTP layers) and vLLM's serving of them feed the
normed state. The embedding and the head are the decoder's own (shared, not copied); each
module has its own norms, projection, block and head norm. Positions keep their place in
the row: the last k positions of module k embed a stand-in token and have no target, and
since attention is causal they change no earlier position, so the result equals the
report's sequence truncated to T - k positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention import LayerMask
from kempnerforge.model.heads import IGNORE_INDEX, HeadLossSpec, head_loss
from kempnerforge.model.norm import RMSNorm


class MTPModule(nn.Module):
    """One multi-token-prediction depth: two input norms, the projection that joins them,
    a decoder block and the norm before the shared head (Hugging Face's enorm, hnorm,
    eh_proj, the layer's decoder tensors and shared_head.norm)."""

    def __init__(self, cfg: ModelConfig, block: nn.Module) -> None:
        super().__init__()
        zero_centered = cfg.zero_centered_norms
        self.enorm = RMSNorm(cfg.dim, cfg.norm_eps, zero_centered=zero_centered)
        """Normalizes the embedding of the token k ahead."""
        self.hnorm = RMSNorm(cfg.dim, cfg.norm_eps, zero_centered=zero_centered)
        """Normalizes the previous depth's hidden state."""
        self.eh_proj = nn.Linear(2 * cfg.dim, cfg.dim, bias=False)
        """[embedding ; hidden] (2 * dim) -> the block's input (dim)."""
        self.block = block
        """A decoder block built as the decoder's last one (its attention window, RoPE
        table and feed-forward kind)."""
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps, zero_centered=zero_centered)
        """Normalizes the block's output before the shared head (shared_head.norm)."""

    def forward(
        self,
        hidden: torch.Tensor,
        ahead: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: LayerMask = None,
    ) -> torch.Tensor:
        """h^k from h^{k-1} (batch, seq, dim) and the embeddings of the tokens k ahead
        (batch, seq, dim), after the head norm: it feeds both the head and depth k + 1."""
        joined = torch.cat([self.enorm(ahead), self.hnorm(hidden)], dim=-1)
        return self.norm(self.block(self.eh_proj(joined), cos, sin, mask))


class MTPModules(nn.ModuleList):
    """The model's MTP modules in depth order (state dict ``mtp.<k - 1>.*``), and the summed
    losses of their latest forward, left for the training step to add to its objective
    (training/objectives/mtp.py) as MoE layers leave their router losses."""

    def __init__(self, modules: list[MTPModule]) -> None:
        super().__init__(modules)
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None
        """(summed cross-entropy per depth, differentiable; supervised targets per depth)
        of the latest forward given targets, both (depth,) on the device; None after the
        step has taken them."""
        self.totals: torch.Tensor | None = None
        """(2, depth) fp64: the step's summed losses and targets so far, detached."""

    def blocks(self) -> list[nn.Module]:
        """Each depth's decoder block, in depth order."""
        return [m.block for m in self if isinstance(m, MTPModule)]

    def run(
        self,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        embed: Callable[[torch.Tensor], torch.Tensor],
        head: nn.Linear,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: LayerMask,
        spec: HeadLossSpec,
    ) -> None:
        """Run every depth over the decoder's output ``hidden`` (after its final norm) and
        keep their summed cross-entropies against ``targets`` (depth, batch, seq) in
        ``last``.

        The head's loss is chunked as ``spec`` says, without its z-loss (the report's
        MTP loss is the cross-entropy alone)."""
        spec = HeadLossSpec(spec.chunk_tokens, 0.0)
        sums = []
        for depth, module in enumerate(self, start=1):
            hidden = module(hidden, embed(tokens_ahead(input_ids, depth)), *rope, mask)
            sums.append(head_loss(hidden, head, targets[depth - 1], spec).loss_sum)
        counts = (targets != IGNORE_INDEX).sum(dim=(1, 2))
        self.last = (torch.stack(sums), counts)


def tokens_ahead(input_ids: torch.Tensor, depth: int) -> torch.Tensor:
    """``input_ids`` (batch, seq) moved ``depth`` positions left: position i holds token
    i + depth; the last ``depth`` positions repeat the row's last token (a stand-in whose
    targets are ignored)."""
    tail = input_ids[:, -1:].expand(-1, min(depth, input_ids.shape[1]))
    return torch.cat([input_ids[:, depth:], tail], dim=1)


def mtp_targets(labels: torch.Tensor, doc_ids: torch.Tensor | None, depth: int) -> torch.Tensor:
    """The targets of every depth, (depth, batch, seq): depth k at position i predicts
    ``labels[i + k]`` (token i + k + 1).

    IGNORE_INDEX where i + k is past the row, where that label is itself ignored (a loss
    mask, a document's first token), and, with ``doc_ids`` (batch, seq; a packed row's
    documents), where position i + k is in another document than i: nothing is predicted
    from another document's context.
    """
    seq = labels.shape[1]
    out = labels.new_full((depth, *labels.shape), IGNORE_INDEX)
    for k in range(1, min(depth, seq - 1) + 1):
        ahead = labels[:, k:]
        if doc_ids is not None:
            ahead = ahead.masked_fill(doc_ids[:, k:] != doc_ids[:, :-k], IGNORE_INDEX)
        out[k - 1, :, : seq - k] = ahead
    return out


def mtp_modules(model: nn.Module) -> MTPModules | None:
    """The MTP modules of ``model`` (any wrapping), found once and remembered on it; None
    for a model without them."""
    key = "_kempnerforge_mtp_modules"
    if key not in model.__dict__:
        found = [m for m in model.modules() if isinstance(m, MTPModules)]
        model.__dict__[key] = found[0] if found else None
    return model.__dict__[key]
