"""The decoder-only Transformer (Llama-3 layout) and its parameter and FLOP accounting."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.model.attention import (
    Attention,
    CachedKeys,
    DecodeStep,
    LatentAttention,
    LayerMask,
    MaskRule,
    SequenceSplit,
    active_split,
    model_rope_tables,
    prepare_masks,
)
from kempnerforge.model.contract import DecoderStack, FamilyModel
from kempnerforge.model.embedding import TokenEmbedding
from kempnerforge.model.heads import HeadLoss, HeadLossSpec, head_loss
from kempnerforge.model.lora import LoRALinear
from kempnerforge.model.meta import on_meta
from kempnerforge.model.mlp import SwiGLU
from kempnerforge.model.moe import MoEFeedForward, Router
from kempnerforge.model.mtp import MTPModule, MTPModules
from kempnerforge.model.norm import RMSNorm
from kempnerforge.model.weight_init import copy_full_tensor as copy_full_tensor  # re-exported
from kempnerforge.model.weight_init import fill_parameter, init_std, parameter_seed


class TransformerBlock(nn.Module):
    """One block: attention then feed-forward, each in a residual branch normalised as
    model.norm_placement says: 'pre', h = x + attention(norm(x)) (Llama); 'post', h = x +
    norm(attention(x)) (OLMo 2); 'sandwich', both (Gemma). The norms a placement does not
    use are None, so they hold no weights."""

    def __init__(self, cfg: ModelConfig, index: int = 0) -> None:
        super().__init__()
        pre = cfg.norm_placement in ("pre", "sandwich")
        post = cfg.norm_placement in ("post", "sandwich")
        self.attention_norm = block_norm(cfg) if pre else None
        """Normalizes the attention input ('pre', 'sandwich')."""
        self.attention: Attention | LatentAttention = (
            LatentAttention(cfg, index) if cfg.is_mla else Attention(cfg, index)
        )
        """Grouped-query causal self-attention, or multi-head latent attention
        (model.mla_kv_rank)."""
        self.attention_post_norm = block_norm(cfg) if post else None
        """Normalizes the attention output before the residual add ('post', 'sandwich')."""
        self.ffn_norm = block_norm(cfg) if pre else None
        """Normalizes the feed-forward input ('pre', 'sandwich')."""
        self.feed_forward: SwiGLU | MoEFeedForward = (
            MoEFeedForward(cfg)
            if cfg.is_moe_layer(index)
            else SwiGLU(cfg.dim, cfg.hidden_dim, cfg.ffn_activation)
        )
        """Gated feed-forward (model.ffn_activation), or routed experts in an MoE block (see
        model/moe/layer.py)."""
        self.ffn_post_norm = block_norm(cfg) if post else None
        """Normalizes the feed-forward output before the residual add ('post', 'sandwich')."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: LayerMask | CachedKeys = None,
    ) -> torch.Tensor:
        return self.residuals(x, lambda y: self.attention(y, cos, sin, mask), self.feed_forward)

    def residuals(
        self,
        x: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        feed_forward: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """The block's two residual branches around ``attend`` and ``feed_forward``, with
        the norms where model.norm_placement puts them. The cached decoder passes its own
        attention (over the cache), so both paths share one wiring."""
        h = x + _maybe_norm(self.attention_post_norm, attend(_maybe_norm(self.attention_norm, x)))
        out = feed_forward(_maybe_norm(self.ffn_norm, h))
        return h + _maybe_norm(self.ffn_post_norm, out)


def block_norm(cfg: ModelConfig) -> RMSNorm:
    """An RMSNorm over the residual stream's width, zero-centred as the model's are."""
    return RMSNorm(cfg.dim, cfg.norm_eps, zero_centered=cfg.zero_centered_norms)


def _maybe_norm(norm: RMSNorm | None, x: torch.Tensor) -> torch.Tensor:
    return x if norm is None else norm(x)


class Transformer(FamilyModel):
    """Token embedding, n_layers pre-norm blocks, final RMSNorm and a bias-free output head.

    With cfg.tie_embeddings the head's weight is the embedding's weight (one Parameter). The
    RoPE tables are non-persistent fp32 buffers: they follow .to(device) but stay out of the
    state dict. init_weights() recomputes them and re-ties the head, so a model built on the
    meta device and materialized with to_empty() is complete after one init_weights() call.

    ``layers`` is keyed by the layer's index ("0", "1", ...), so a pipeline stage that keeps
    only some layers (keep_layers) names every parameter as the whole model does, and a
    checkpoint reads the same in every layout. A stage without the embedding takes hidden
    states instead of token ids; one without the head returns hidden states.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        """The shape this model was built from."""
        self.sequence_split: SequenceSplit | None = None
        """Under context parallelism: input_ids holds this rank's slice of each sequence
        (doc_ids the whole sequence), so RoPE takes the slice's global positions (held_spans:
        one span, or two under ring attention)."""
        self.attention_kernel = "auto"
        """How attention applies its mask rules (train.attention_kernel; kernels.py)."""
        # Build on meta and materialize once: the default inits of nn.Linear / nn.Embedding
        # would cost time and draw from the RNG, only to be overwritten by init_weights(). So
        # the weights depend on the seed alone, exactly as after meta + to_empty + init_weights.
        device = torch.get_default_device()
        with on_meta():
            self._build(cfg)
        self.to_empty(device=device)
        self.init_weights()

    def _build(self, cfg: ModelConfig) -> None:
        """Create the submodules and RoPE buffers, uninitialized; the head is tied later."""
        self.tok_embeddings: nn.Embedding | None = TokenEmbedding(
            cfg.vocab_size, cfg.dim, cfg.embedding_multiplier
        )
        """Token id -> residual-stream vector, times model.embedding_multiplier (None on a
        stage after the first)."""
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        """The Transformer blocks by index, applied in index order."""
        self.norm: RMSNorm | None = block_norm(cfg)
        """Final normalization before the output head (None on a stage without the head)."""
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        """Residual stream -> vocabulary logits; its weight is tok_embeddings' when tied."""
        blocks = [TransformerBlock(cfg, cfg.n_layers - 1) for _ in range(cfg.mtp_depth)]
        self.mtp = MTPModules([MTPModule(cfg, b) for b in blocks]) if blocks else None
        """The multi-token-prediction modules (model.mtp_depth; model/mtp.py), run only by a
        forward given their targets; None without them."""
        shape = (cfg.rope_kinds, cfg.max_seq_len, cfg.rope_dim // 2)
        self.rope_cos: torch.Tensor
        """RoPE cosines, (rope kinds, max_seq_len, rope_dim // 2), fp32; not checkpointed
        (rope_dim: the head, or under MLA its RoPE part).
        Table 0 serves every layer, or with model.rope_local_theta the full-attention
        layers and table 1 the sliding ones (ModelConfig.layer_rope)."""
        self.rope_sin: torch.Tensor
        """RoPE sines, laid out as rope_cos."""
        self.register_buffer("rope_cos", torch.empty(shape), persistent=False)
        self.register_buffer("rope_sin", torch.empty(shape), persistent=False)

    def decoder_stacks(self) -> list[DecoderStack]:
        """Itself: the text model is one stack of blocks with both ends (or, on a pipeline
        rank, the blocks and ends of the stages it keeps)."""
        return [self]

    def training_head_blocks(self) -> list[tuple[int, nn.Module]]:
        """The multi-token-prediction modules' blocks, indexed n_layers + k after the
        decoder's: sharded, checkpointed and compiled like the decoder's blocks."""
        blocks = [] if self.mtp is None else self.mtp.blocks()
        return [(self.cfg.n_layers + k, block) for k, block in enumerate(blocks)]

    def keep_layers(self, first: int, last: int) -> None:
        """Keep only layers first..last-1 (a pipeline stage): the embedding stays only when
        first == 0, the final norm and head only when last == n_layers."""
        for index in list(self.layers):
            if not first <= int(index) < last:
                del self.layers[index]
        if first > 0:
            self.tok_embeddings = None
        if last < self.cfg.n_layers:
            self.norm = None
            self.output = None
            self.mtp = None

    def _init_std(self, name: str) -> float | None:
        """The normal std parameter ``name`` is drawn with; None for a norm gain (ones)."""
        return init_std(self.cfg, name)

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Draw every weight and recompute the RoPE tables; nothing to do while on meta.

        Each parameter is drawn from generators seeded by ``seed`` (by default one draw
        from the global torch RNG) and the parameter's name: normal(0, init_std) for the
        embedding and every Linear, init_std / sqrt(2 * n_layers) for the two projections
        that write the residual stream (attention.wo, feed_forward.w2), ones for norm
        gains. So the weights depend on the seed alone, whatever the layout: a sharded
        (DTensor) parameter draws only the tiles of its own shard and holds its slice of
        the unsharded values (see model/weight_init.py), a pipeline stage the same layers
        as the whole model. No rank ever holds a whole parameter it does not own.
        """
        self.tie_head()
        if any(p.is_meta for p in self.parameters()):
            return
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        self.init_parameters(seed)
        self.reset_buffers()

    def tie_head(self) -> None:
        """Make the head's weight the embedding's again when cfg.tie_embeddings: to_empty()
        gives each module its own tensor, which silently unties them."""
        if (
            self.cfg.tie_embeddings
            and self.output is not None
            and self.tok_embeddings is not None
            and self.output.weight is not self.tok_embeddings.weight
        ):
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_parameters(self, seed: int, prefix: str = "") -> None:
        """Draw every parameter from generators seeded by ``seed`` and its name.

        ``prefix`` is prepended to the names that seed the generators: a model that holds
        this one as a submodule passes the submodule's path (``"decoder."``), so each
        parameter's draw follows its name in the enclosing model's state dict.
        """
        gains = {
            f"{name}.weight": 1.0 - module.gain_offset
            for name, module in self.named_modules()
            if isinstance(module, RMSNorm)
        }
        adapters = {
            f"{name}.{param}": std
            for name, module in self.named_modules()
            if isinstance(module, LoRALinear)
            for param, std in module.adapter_init_stds().items()
        }
        for name, param in self.named_parameters():
            # A pipeline rank's copy of a tied embedding draws the embedding's values.
            tied_copy = self.tied_head_copy and name == "output.weight"
            drawn_as = "tok_embeddings.weight" if tied_copy else name
            seed_of_name = parameter_seed(seed, prefix + drawn_as)
            std = adapters[name] if name in adapters else self._init_std(name)
            fill_parameter(param, std, seed_of_name, constant=gains.get(name, 1.0))

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables and zero the routers' balancing biases: to_empty()
        leaves buffers uninitialized and they are not drawn like parameters."""
        cfg = self.cfg
        for module in self.modules():
            if isinstance(module, Router) and module.expert_bias is not None:
                module.expert_bias.zero_()
        for kind, (cos, sin) in enumerate(model_rope_tables(cfg, self.rope_cos.device)):
            self.rope_cos[kind].copy_(cos)
            self.rope_sin[kind].copy_(sin)

    def forward(
        self,
        input_ids: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        *,
        labels: torch.Tensor | None = None,
        loss_spec: HeadLossSpec | None = None,
        mtp_targets: torch.Tensor | None = None,
        decode: DecodeStep | None = None,
    ) -> torch.Tensor | HeadLoss:
        """Logits (batch, seq, vocab_size) for input_ids (batch, seq), seq <= max_seq_len.

        doc_ids (batch, seq), if given, numbers the packed documents of each row; tokens then
        attend only to earlier tokens of their own document. Without it the whole row is one
        causal sequence. A sliding layer (model.sliding_window) also sees only its window.
        Each layer's mask is prepared once per forward from its rule and shared by the
        layers with the same rule (attention_masks). No host syncs on a GPU: nothing here
        reads a tensor value into Python (the CPU's kernel plans its pieces from doc_ids,
        which live on the host there).
        A pipeline stage without the embedding takes hidden states (batch, seq, dim) in
        ``input_ids``; one without the head returns hidden states.

        With ``labels`` (batch, seq) a model holding the head returns a HeadLoss instead of
        logits: the summed cross-entropy (plus z-loss) and its per-token values, computed
        in chunks of ``loss_spec.chunk_tokens`` tokens so the whole logits never exist
        (see model/heads/head_loss.py; ``loss_spec`` None takes HeadLossSpec's defaults). It is
        computed here, not by the caller, because FSDP gathers the head's weight only
        inside this forward.

        With ``mtp_targets`` (model.mtp_depth, batch, seq; model/mtp.py's mtp_targets) the
        multi-token-prediction modules run too and leave their losses on ``self.mtp``;
        without, they cost nothing (eval, generation).

        With ``decode`` input_ids are the new tokens of a decoding step through a key/value
        cache (model/attention/decode_cache.py: each row at its own positions).
        """
        batch, seq_len = input_ids.shape[:2]
        if decode is None:
            cos, sin = self.rope(seq_len)
            masks = self.attention_masks(doc_ids, batch, seq_len, input_ids.device)
        else:
            cos, sin = decode.rope_rows(self.rope_cos, self.rope_sin)
            masks = {i: decode.layer(i, self.cfg.layer_window(int(i))) for i in self.layers}
        h = self.run_layers(self.embed(input_ids), cos, sin, masks)
        if self.norm is None or self.output is None:
            return h
        if self.mtp is not None and mtp_targets is not None:
            mask = masks[str(self.cfg.n_layers - 1)]  # each block is built as the last one
            assert not isinstance(mask, CachedKeys), "multi-token prediction does not decode"
            spec = loss_spec or HeadLossSpec()
            normed = self.norm(h)  # what the head reads is what depth 1 reads (model/mtp.py)
            self.mtp.run(
                normed, input_ids, mtp_targets, self.embed, self.output, (cos, sin), mask, spec
            )
        return self.apply_head(h, labels, loss_spec)

    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE (cos, sin) rows of positions 0 .. seq_len - 1, or under context
        parallelism of this rank's slice of seq_len positions (its spans, in order); each
        (rope kinds, positions, head_dim // 2), every layer taking its own table."""
        split = active_split(self)
        spans = [(0, seq_len)] if split is None else split.spans(seq_len)
        if len(spans) == 1:
            ((first, last),) = spans
            return self.rope_cos[:, first:last], self.rope_sin[:, first:last]
        cos = torch.cat([self.rope_cos[:, a:b] for a, b in spans], dim=1)
        return cos, torch.cat([self.rope_sin[:, a:b] for a, b in spans], dim=1)

    def attention_masks(
        self,
        doc_ids: torch.Tensor | None,
        batch: int,
        seq_len: int,
        device: torch.device,
    ) -> dict[str, LayerMask]:
        """Each kept layer's prepared mask, by index: its rule (documents when doc_ids is
        given, its sliding window) prepared once per distinct rule for this model's
        attention_kernel, or for the ring under ring attention. ``seq_len`` is the length
        this rank holds; under context parallelism the masks cover the whole sequence,
        whose doc_ids are whole."""
        split = active_split(self)
        whole = seq_len if split is None else seq_len * split.size
        ring = 1 if split is None else split.ring
        documents = doc_ids is not None
        indices = list(self.layers)
        rules = [MaskRule(documents, self.cfg.layer_window(int(i))) for i in indices]
        kernel = self.attention_kernel
        lse = self.cfg.attention_sinks  # sinks need every kernel's log-sum-exp
        masks = prepare_masks(rules, doc_ids, batch, whole, device, kernel, ring, lse=lse)
        return dict(zip(indices, masks, strict=True))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token ids (batch, seq) -> residual stream (batch, seq, dim); a stage without the
        embedding passes its input (hidden states) through."""
        return input_ids if self.tok_embeddings is None else self.tok_embeddings(input_ids)

    def run_layers(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        masks: Mapping[str, LayerMask | CachedKeys] | None = None,
        after_layer: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run the blocks in index order over the residual stream ``h``.

        ``masks`` are the layers' masks (attention_masks); None prepares them for rows of
        one document each (causal, each sliding layer through its window).
        ``after_layer(index, h)``, if given, is called on each block's output and its result
        continues the stream: a model that interleaves its own blocks with these (gated
        cross-attention) reuses the loop instead of copying it.
        """
        if masks is None:
            masks = self.attention_masks(None, h.shape[0], h.shape[1], h.device)
        for index, layer in self.layers.items():
            h = layer(h, cos, sin, masks[index])
            if after_layer is not None:
                h = after_layer(int(index), h)
        return h

    def apply_head(
        self,
        h: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_spec: HeadLossSpec | None = None,
    ) -> torch.Tensor | HeadLoss:
        """Final norm then the head: logits, or with ``labels`` the HeadLoss (see forward).

        Only for a model holding the norm and the head (not a pipeline stage without them).
        """
        assert self.norm is not None and self.output is not None, "a stage without the head"
        if labels is not None:
            return head_loss(self.norm(h), self.output, labels, loss_spec or HeadLossSpec())
        return self.output(self.norm(h))

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Count parameters, a tied embedding/head matrix once.

        exclude_embedding drops the input embedding table, which is a lookup and costs no
        FLOPs. A tied matrix is kept, because it is still the output head's matmul; so for a
        tied model both counts are equal.
        """
        total = sum(p.numel() for p in self.parameters())
        if exclude_embedding and not self.cfg.tie_embeddings and self.tok_embeddings is not None:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at seq_len for the whole model (see flops_per_token)."""
        return flops_per_token(self.cfg, seq_len)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token at seq_len: 6 * N + 12 * n_layers * width * seq_len.

    N is every weight that takes part in a token's matmuls: the active parameters (an MoE
    block counts its router, its top_k routed experts and its shared experts, not every
    expert) but an untied input embedding table (a lookup, no FLOPs), output head
    included, once more per multi-token-prediction module (model.mtp_depth), whose blocks
    count as layers below. A forward pass costs 2 FLOPs per multiply-add, so 2 * N for
    the weights, and backward twice the forward (grads w.r.t. inputs and weights): 6 * N.
    Attention adds, per layer and token, QK^T and AV at seq_len * width multiply-adds
    each, width being the heads' total width
    n_heads * head_dim (the model's dim unless model.head_size sets it apart; under MLA
    the query/key heads' width for QK^T and the value heads' for AV): 2 * 2 *
    seq_len * width forward, times 3 for forward plus backward. The causal mask's skipped
    half is not subtracted, matching the usual MFU convention. From the config, so a
    sharded or pipelined rank that holds part of the model reports the whole model's cost.
    """
    n = cfg.num_active_params() - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim)
    n += cfg.mtp_depth * cfg.vocab_size * cfg.dim
    widths = cfg.n_heads * (cfg.qk_head_dim + cfg.v_head_dim)
    return 6.0 * n + 6.0 * (cfg.n_layers + cfg.mtp_depth) * widths * seq_len


def build_model(cfg: ModelConfig) -> Transformer:
    """Construct the Transformer for cfg on the current default device, initialized.

    Call it under `with on_meta():` (model/meta.py) to get shapes without memory; then
    to_empty(device=...) and init_weights() make it real.
    """
    return Transformer(cfg)
