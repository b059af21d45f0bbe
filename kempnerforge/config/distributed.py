"""[distributed]: how the world of processes is split into parallel dimensions."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import MAX_SIZE, check_positive
from kempnerforge.config.errors import ConfigError

MAX_TIMEOUT_S = 30 * 24 * 3600.0


@dataclass
class DistributedConfig:
    dp_shard: int = -1
    """Data-parallel degree, in processes (1 to 2**31 - 1); -1 takes whatever the other
    degrees leave of the world size."""
    tp: int = 1
    """Tensor-parallel degree, in processes; 1 to 2**31 - 1."""
    pp: int = 1
    """Pipeline-parallel degree (number of stages); 1 to 2**31 - 1."""
    backend: str = "auto"
    """Process-group backend: 'auto' (nccl on CUDA, gloo on CPU), 'gloo' or 'nccl'."""
    timeout_s: float = 1800.0
    """Timeout of collective operations, in seconds; > 0 and at most 2592000 (30 days)."""

    def __post_init__(self) -> None:
        if self.dp_shard != -1:
            check_positive("distributed.dp_shard", self.dp_shard, MAX_SIZE)
        check_positive("distributed.tp", self.tp, MAX_SIZE)
        check_positive("distributed.pp", self.pp, MAX_SIZE)
        # The timeout becomes a timedelta and a millisecond count in the process-group
        # backends; 30 days is longer than any job a scheduler keeps alive.
        check_positive("distributed.timeout_s", self.timeout_s, MAX_TIMEOUT_S)
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError("distributed.backend", self.backend, "'auto', 'gloo' or 'nccl'")

    def resolved_dp(self, world_size: int) -> int:
        """Data-parallel degree for this world size (dp_shard = -1 resolved)."""
        if self.dp_shard == -1:
            return max(world_size // (self.tp * self.pp), 1)
        return self.dp_shard
