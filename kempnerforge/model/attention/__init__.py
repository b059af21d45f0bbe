"""Attention kinds: grouped-query self-attention (`self_attention.py`) and multi-head
latent attention (`latent_attention.py`, DeepSeek's MLA), the mask rules
(causal, packed documents, sliding windows: `masks.py`, for any query range and key range)
and the kernels that apply them (`kernels.py`: SDPA's causal kernels, FlexAttention block
masks, the CPU's per-document `segments.py`, a dense mask), rotary positions, and context
parallelism's exchange of sequence slices (heads, and past the head count a ring of
key/value blocks under the same rules: `ring.py`, `ring_blocks.py`), and decoding with a
key/value cache through the training forward (`decode_cache.py`).

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.model.attention.decode_cache import (
    CachedKeys,
    DecodeCache,
    DecodeStep,
    attend_stored,
)
from kempnerforge.model.attention.kernels import (
    LayerMask,
    attend,
    prepare_masks,
    set_attention_kernel,
)
from kempnerforge.model.attention.latent_attention import LatentAttention
from kempnerforge.model.attention.masks import (
    BLOCK_SIZE,
    MaskRule,
    block_mask,
    dense_mask,
    mask_mod,
    tile_documents,
    tile_table,
    visible,
)
from kempnerforge.model.attention.ring import ring_attention
from kempnerforge.model.attention.ring_blocks import RingMask, ring_masks
from kempnerforge.model.attention.rope import (
    RopeScaling,
    apply_rope,
    model_rope_tables,
    rope_tables,
    yarn_frequencies,
)
from kempnerforge.model.attention.self_attention import (
    Attention,
    document_causal_mask,
    needs_document_mask,
)
from kempnerforge.model.attention.sequence_split import (
    SequenceSplit,
    active_split,
    held_parts,
    held_spans,
    set_sequence_split,
    whole_sequences,
)
from kempnerforge.model.attention.sinks import dense_sink_attention

__all__ = [
    "BLOCK_SIZE",
    "Attention",
    "LatentAttention",
    "CachedKeys",
    "DecodeCache",
    "DecodeStep",
    "attend_stored",
    "LayerMask",
    "MaskRule",
    "RingMask",
    "RopeScaling",
    "SequenceSplit",
    "active_split",
    "apply_rope",
    "attend",
    "block_mask",
    "dense_mask",
    "dense_sink_attention",
    "document_causal_mask",
    "held_parts",
    "held_spans",
    "mask_mod",
    "needs_document_mask",
    "prepare_masks",
    "ring_attention",
    "ring_masks",
    "model_rope_tables",
    "rope_tables",
    "set_attention_kernel",
    "set_sequence_split",
    "tile_documents",
    "tile_table",
    "visible",
    "whole_sequences",
    "yarn_frequencies",
]
