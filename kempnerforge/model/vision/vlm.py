"""The vision-language model: vision encoder -> adapter -> the decoder-only Transformer,
the image entering the decoder as prefix tokens (joint decoder) or through gated
cross-attention blocks between decoder layers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.vlm import (
    AdapterConfig,
    VisionEncoderConfig,
    VisionSpec,
    VLMConfig,
    resolve_vision,
)
from kempnerforge.model.attention import SequenceSplit, active_split, held_parts
from kempnerforge.model.contract import DecoderStack, FamilyModel
from kempnerforge.model.heads import HeadLoss, HeadLossSpec
from kempnerforge.model.meta import on_meta
from kempnerforge.model.transformer import Transformer, flops_per_token
from kempnerforge.model.vision.adapter import ImageAdapter, build_adapter
from kempnerforge.model.vision.cross_attention import GatedCrossAttentionBlock
from kempnerforge.model.vision.encoder import VisionEncoder, build_vision_encoder

AfterLayer = Callable[[int, torch.Tensor], torch.Tensor]
"""(decoder layer index, residual stream) -> residual stream, run after that layer."""


class VisionLanguageModel(FamilyModel):
    """Images and text in, logits (or the loss) over the text positions out.

    The submodules are the freeze groups: ``encoder`` (the vision encoder), ``adapter``
    (encoder features -> decoder width), ``decoder`` (the text Transformer: embedding,
    blocks, final norm, head) and ``cross_attention`` (the gated blocks, keyed by the index
    of the decoder layer each one follows; None for the joint decoder).

    'joint_decoder': the adapted image tokens come first in the decoder's sequence, then
    the text, with one causal mask over both; so every text position sees the whole image.
    'cross_attention': the decoder's sequence is the text alone, and after decoder layer i
    (when (i + 1) is a multiple of vlm.cross_attention_every_n_layers) a gated block lets
    it attend to the image tokens; the gates start closed, so at init the model is the
    text model.

    As the Transformer, it is built on the meta device and materialized once, so the
    weights depend on the seed alone; built under ``torch.device("meta")`` it stays there
    until the caller runs to_empty() and init_weights().
    """

    def __init__(
        self,
        model_cfg: ModelConfig,
        encoder_cfg: VisionEncoderConfig,
        adapter_cfg: AdapterConfig,
        vlm_cfg: VLMConfig,
        spec: VisionSpec,
    ) -> None:
        super().__init__()
        self.cfg = model_cfg
        """The decoder's shape."""
        self.arch = vlm_cfg.arch
        """'joint_decoder' or 'cross_attention'."""
        self.spec = spec
        """The encoder's input and output shape."""
        self.max_text_len = vlm_cfg.max_text_len
        """Text tokens per sample in training and eval (vlm.max_text_len): under context
        parallelism each rank's input_ids are its part of that many."""
        self.sequence_split: SequenceSplit | None = None
        """Under context parallelism: the decoder's sequence (image tokens, then the text)
        is split over the cp ranks as a text model's is; shared with the decoder."""
        device = torch.get_default_device()
        with on_meta():
            self._build(model_cfg, encoder_cfg, adapter_cfg, vlm_cfg, spec)
        self.to_empty(device=device)
        self.init_weights()

    def _build(
        self,
        model_cfg: ModelConfig,
        encoder_cfg: VisionEncoderConfig,
        adapter_cfg: AdapterConfig,
        vlm_cfg: VLMConfig,
        spec: VisionSpec,
    ) -> None:
        """Create the submodules, uninitialized."""
        self.encoder: VisionEncoder = build_vision_encoder(encoder_cfg, spec)
        """Images -> (batch, spec.num_tokens, spec.feature_dim), in its own dtype."""
        self.adapter: ImageAdapter = build_adapter(adapter_cfg, spec, model_cfg.dim)
        """Encoder tokens -> (batch, adapter.num_output_tokens, model.dim)."""
        self.decoder = Transformer(model_cfg)
        """The decoder-only language model."""
        self.cross_attention: nn.ModuleDict | None = None
        """Gated cross-attention blocks by the index of the decoder layer they follow
        (cross_attention arch only)."""
        if vlm_cfg.arch == "cross_attention":
            every = vlm_cfg.cross_attention_every_n_layers
            self.cross_attention = nn.ModuleDict(
                {
                    str(i): GatedCrossAttentionBlock(model_cfg)
                    for i in range(model_cfg.n_layers)
                    if (i + 1) % every == 0
                }
            )

    @property
    def num_image_tokens(self) -> int:
        """Image tokens per sample in the decoder's sequence (0 with cross-attention)."""
        return self.adapter.num_output_tokens if self.cross_attention is None else 0

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Fill every parameter and buffer; nothing to do while on meta.

        Decoder, adapter and cross-attention blocks are drawn as Transformer.init_weights
        draws (one generator per parameter, seeded by ``seed`` and the parameter's name in
        this model, ``seed`` by default one draw from the global torch RNG), so a sharded
        parameter gets its shard of the same full draw; the gates start at zero. The
        encoder fills itself: the random encoder from its constant seed, a pretrained
        tower from its checkpoint directory. The RoPE tables and the tower's position ids
        are recomputed, since to_empty() leaves buffers uninitialized.
        """
        self.decoder.tie_head()
        if any(p.is_meta for p in self.parameters()):
            return
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()))
        self.decoder.init_parameters(seed, prefix="decoder.")
        self.decoder.reset_buffers()
        self.adapter.init_weights(seed, prefix="adapter.")
        for index, block in (self.cross_attention or {}).items():
            assert isinstance(block, GatedCrossAttentionBlock)
            block.init_weights(seed, prefix=f"cross_attention.{index}.")
        self.encoder.init_weights()

    def forward(
        self,
        pixel_values: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        loss_spec: HeadLossSpec | None = None,
    ) -> torch.Tensor | HeadLoss:
        """Logits (batch, seq, vocab_size) over the text positions of input_ids (batch, seq)
        given pixel_values (batch, 3, S, S).

        Position i of the logits belongs to input_ids[:, i]: the caller's labels are
        already shifted (labels[:, i] is the token after input_ids[:, i]); nothing is
        shifted here. With ``labels`` the HeadLoss over the text positions is returned
        instead, computed chunk by chunk as Transformer.forward does (see head_loss.py).
        Under context parallelism input_ids and labels are this rank's part of the text
        (distributed/context_parallel.py slice_batch), possibly none of it, and so is the
        result (see held_image_positions). No host syncs: only shapes are read.
        """
        _check_batch(pixel_values, input_ids, labels)
        # Every cp rank encodes the whole images: the encoder and adapter are not split.
        image = self.adapter(self.encoder(pixel_values))
        text = self.decoder.embed(input_ids)
        held = self.held_image_positions(input_ids.shape[1])
        if self.cross_attention is None:
            # An empty slice where the rank holds no image token keeps the adapter in every
            # rank's graph: with a frozen decoder, backward must still run on every rank,
            # whose attention exchanges gradients with the ranks that hold the image.
            pieces = [image[:, part] for part in held] or [image[:, :0]]
            h = torch.cat([*(piece.to(text.dtype) for piece in pieces), text], dim=1)
            h = self._run_decoder(h, None)
        else:
            blocks = self.cross_attention

            def cross_attend(index: int, hidden: torch.Tensor) -> torch.Tensor:
                key = str(index)
                return blocks[key](hidden, image) if key in blocks else hidden

            h = self._run_decoder(text, cross_attend)
        image_held = sum(part.stop - part.start for part in held)
        return self.decoder.apply_head(h[:, image_held:], labels, loss_spec)

    def held_image_positions(self, text_len: int) -> list[slice]:
        """The parts of the image tokens this rank's decoder sequence holds, in order, for
        ``text_len`` text ids.

        All of them (none with cross-attention) on whole sequences. Under context
        parallelism the sequence of image tokens then ``max_text_len`` text positions is
        split as slice_batch splits it (held_parts): the rank holds one or two spans of it
        in order, so its image tokens come before its text, possibly image tokens only or
        text only, and ``text_len`` must be its text.
        """
        split = active_split(self)
        image_len = self.num_image_tokens
        if split is None:
            return [slice(0, image_len)] if image_len else []
        seq_len = image_len + self.max_text_len
        where = (split.rank, split.size, seq_len)
        text = sum(p.stop - p.start for p in held_parts(*where, image_len, seq_len, split.ring))
        if text != text_len:
            raise ValueError(
                f"input_ids has {text_len} positions; under context parallelism cp rank "
                f"{split.rank} of {split.size} holds {text} of the "
                f"{image_len} image + {self.max_text_len} text positions (vlm.max_text_len; "
                "slice whole captions with slice_batch)"
            )
        return held_parts(*where, 0, image_len, split.ring)

    def _run_decoder(self, h: torch.Tensor, after_layer: AfterLayer | None) -> torch.Tensor:
        """The decoder's blocks over the residual stream h, causal, RoPE from position 0
        (under context parallelism from the global position of the rank's first)."""
        seq_len = h.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(
                f"the decoder's sequence has {seq_len} positions ({self.num_image_tokens} "
                f"image tokens + the text); model.max_seq_len is {self.cfg.max_seq_len}"
            )
        cos, sin = self.decoder.rope(seq_len)
        return self.decoder.run_layers(h, cos, sin, None, after_layer)

    def decoder_stacks(self) -> list[DecoderStack]:
        """The text decoder: its blocks are the ones every layout splits, checkpoints and
        compiles; the encoder's and the gated blocks are units of their own (fsdp_units)."""
        return [self.decoder]

    def fsdp_units(self) -> list[nn.Module]:
        """The modules to shard as FSDP units of their own, in the parameter (mixed
        precision) dtype, besides the decoder blocks: the adapter and each gated block."""
        return [self.adapter, *(self.cross_attention or {}).values()]

    def own_dtype_fsdp_units(self) -> list[nn.Module]:
        """The FSDP units that keep their parameters' dtype in compute, so a pretrained
        tower runs in the dtype it was saved in: the encoder's (for a tower each layer,
        then the module holding its embeddings and norms)."""
        return self.encoder.fsdp_modules()

    def num_params(self) -> int:
        """Parameters of the whole model (a tied embedding/head matrix once)."""
        return sum(p.numel() for p in self.parameters())

    def group_sizes(self) -> dict[str, int]:
        """Parameters per freeze group ('encoder', 'adapter', 'decoder', and
        'cross_attention' when the arch has it), whole-model counts also when sharded."""
        sizes: dict[str, int] = {}
        for name, param in self.named_parameters():
            group = name.split(".", 1)[0]
            sizes[group] = sizes.get(group, 0) + param.numel()
        return sizes

    def flops_per_text_token(self, text_len: int) -> float:
        """Approximate training FLOPs of one sample divided by its ``text_len`` text
        positions, for MFU.

        The decoder's cost over its whole sequence (image prefix included for the joint
        decoder: transformer.flops_per_token at that length, times the length); the adapter
        and the gated blocks trained (6 FLOPs per weight and token they process, plus the
        blocks' attention over the image tokens); the encoder forward only (2 per weight
        and token: it is usually frozen, and its attention is not counted). The loop counts
        *supervised* text tokens, so padded captions make the reported MFU a lower bound.
        """
        sizes = self.group_sizes()
        positions = self.num_image_tokens + text_len
        total = flops_per_token(self.cfg, positions) * positions
        total += 6.0 * sizes.get("adapter", 0) * self.adapter.num_output_tokens
        total += 2.0 * sizes.get("encoder", 0) * self.spec.num_tokens
        if self.cross_attention is not None:
            context = self.adapter.num_output_tokens
            per_block_attention = 12.0 * self.cfg.dim * context
            blocks = len(self.cross_attention)
            total += (6.0 * sizes.get("cross_attention", 0) + blocks * per_block_attention) * (
                text_len
            )
        return total / text_len


def _check_batch(
    pixel_values: torch.Tensor, input_ids: torch.Tensor, labels: torch.Tensor | None
) -> None:
    """Shape checks that name the tensors (read on the host, no device sync)."""
    if input_ids.ndim != 2 or pixel_values.shape[0] != input_ids.shape[0]:
        raise ValueError(
            f"pixel_values {tuple(pixel_values.shape)} and input_ids {tuple(input_ids.shape)} "
            "must be (batch, 3, S, S) and (batch, seq) with the same batch"
        )
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"labels {tuple(labels.shape)} must have input_ids' shape {tuple(input_ids.shape)}"
        )


def build_vlm(
    model_cfg: ModelConfig,
    encoder_cfg: VisionEncoderConfig | None,
    adapter_cfg: AdapterConfig | None,
    vlm_cfg: VLMConfig | None,
    spec: VisionSpec | None = None,
) -> VisionLanguageModel:
    """The vision-language model of these sections ([model], [vision_encoder], [adapter],
    [vlm]), on the current default device.

    ``spec`` is the encoder's shape (read from the tower's config files when omitted);
    no [adapter] means the default adapter. Under ``torch.device("meta")`` nothing is
    allocated or loaded; then to_empty(device=...) and init_weights() make it real.
    """
    if vlm_cfg is None or encoder_cfg is None:
        raise ValueError("build_vlm needs a job with [vlm] and [vision_encoder] sections")
    return VisionLanguageModel(
        model_cfg,
        encoder_cfg,
        adapter_cfg or AdapterConfig(),
        vlm_cfg,
        spec or resolve_vision(encoder_cfg),
    )
