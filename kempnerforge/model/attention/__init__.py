"""Attention kinds: grouped-query self-attention with its masks, rotary positions, and context
parallelism's exchange of sequence slices (heads, and past the head count a ring of key/value
blocks).

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.model.attention.ring import RingDocuments, ring_attention, ring_documents
from kempnerforge.model.attention.ring_blocks import visible
from kempnerforge.model.attention.rope import apply_rope, rope_tables
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

__all__ = [
    "Attention",
    "RingDocuments",
    "SequenceSplit",
    "active_split",
    "apply_rope",
    "document_causal_mask",
    "held_parts",
    "held_spans",
    "needs_document_mask",
    "ring_attention",
    "ring_documents",
    "rope_tables",
    "set_sequence_split",
    "visible",
    "whole_sequences",
]
