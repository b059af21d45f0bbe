"""Attention kinds: grouped-query self-attention with its masks, rotary positions, and context
parallelism's exchange of sequence slices.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.model.attention.rope import apply_rope, rope_tables
from kempnerforge.model.attention.self_attention import (
    Attention,
    document_causal_mask,
    needs_document_mask,
)
from kempnerforge.model.attention.sequence_split import (
    SequenceSplit,
    active_split,
    held_span,
    set_sequence_split,
    whole_sequences,
)

__all__ = [
    "Attention",
    "SequenceSplit",
    "active_split",
    "apply_rope",
    "document_causal_mask",
    "held_span",
    "needs_document_mask",
    "rope_tables",
    "set_sequence_split",
    "whole_sequences",
]
