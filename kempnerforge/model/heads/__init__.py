"""Output heads and their losses: the chunked head fused with cross-entropy, on one rank or over
tensor-parallel vocabulary shards.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.model.heads.head_loss import (
    IGNORE_INDEX,
    HeadLoss,
    HeadLossSpec,
    logits_head_loss,
    token_losses,
    z_loss_terms,
)
from kempnerforge.model.heads.vocab_parallel_loss import head_loss

__all__ = [
    "IGNORE_INDEX",
    "HeadLoss",
    "HeadLossSpec",
    "head_loss",
    "logits_head_loss",
    "token_losses",
    "z_loss_terms",
]
