"""[lora] in the build: adapters put on the model before it is parallelised, the base
frozen once it is materialised (model/lora.py holds the adapter itself)."""

from __future__ import annotations

from torch import nn

from kempnerforge.config.lora import LoRAConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.fsdp import refresh_sharded_trainable
from kempnerforge.model.lora import adaptable_linears, apply_lora, freeze_base

logger = get_logger(__name__)


def add_adapters(model: nn.Module, lora: LoRAConfig) -> list[str]:
    """Put ``lora``'s adapters on ``model`` (on the meta device, before parallelisation),
    in place; return the adapted module paths ([] when lora.rank = 0).

    A target no block of this model (or of this pipeline rank's stages) has is a
    ConfigError naming it: an adapter that silently trains nothing would be a lost run.
    """
    if not lora.enabled:
        return []
    present = {path.rsplit(".", 1)[-1] for path in adaptable_linears(model)}
    missing = [name for name in lora.projections if name not in present]
    if missing:
        raise ConfigError(
            "lora.target_modules",
            lora.target_modules,
            f"projections this model's blocks have: {', '.join(sorted(present)) or 'none'}",
            f"{', '.join(missing)} is in no decoder block's attention or dense feed-forward "
            "(an MoE layer's experts and latent attention's low-rank projections are not "
            "adapted)",
        )
    return apply_lora(
        model, lora.projections, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout
    )


def freeze_for_adapters(model: nn.Module, lora: LoRAConfig) -> None:
    """With adapters, freeze every other parameter (after materialisation: parallelising
    re-creates parameters) and log what trains."""
    if not lora.enabled:
        return
    trainable, frozen = freeze_base(model)
    refresh_sharded_trainable(model)
    logger.info(
        "lora: rank %d, alpha %g on %s: %s trainable parameters, %s frozen (this rank)",
        lora.rank,
        lora.alpha,
        ", ".join(lora.projections),
        f"{trainable:,}",
        f"{frozen:,}",
    )
