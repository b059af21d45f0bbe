"""[distributed]: how the world of processes is split into parallel dimensions."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import check_positive
from kempnerforge.config.errors import ConfigError


@dataclass
class DistributedConfig:
    dp_shard: int = -1
    """Data-parallel degree; -1 takes whatever the other degrees leave of the world size."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages)."""
    backend: str = "auto"
    """Process-group backend: 'auto' (nccl on CUDA, gloo on CPU), 'gloo' or 'nccl'."""
    timeout_s: float = 1800.0
    """Timeout of collective operations, in seconds."""

    def __post_init__(self) -> None:
        if self.dp_shard != -1:
            check_positive("distributed.dp_shard", self.dp_shard)
        check_positive("distributed.tp", self.tp)
        check_positive("distributed.pp", self.pp)
        check_positive("distributed.timeout_s", self.timeout_s)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError("distributed.backend", self.backend, "'auto', 'gloo' or 'nccl'")

    def resolved_dp(self, world_size: int) -> int:
        """Data-parallel degree for this world size (dp_shard = -1 resolved)."""
        if self.dp_shard == -1:
            return max(world_size // (self.tp * self.pp), 1)
        return self.dp_shard
