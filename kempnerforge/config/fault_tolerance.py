"""[fault_tolerance]: replica groups on torchft that train on while a group is lost."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kempnerforge.config.checks import (
    MAX_SIZE,
    check_at_least,
    check_in_range,
    check_positive,
)
from kempnerforge.core.errors import ConfigError

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""The environment variable torchft (and fault_tolerance.lighthouse = "") reads the
lighthouse address from."""
REPLICA_GROUP_ENV = "KEMPNERFORGE_REPLICA_GROUP"
"""The environment variable a launcher sets to a group's id when fault_tolerance.replica_group
is -1 (scripts/slurm/ft_groups.sbatch does)."""

MAX_TIMEOUT_S = 7 * 24 * 3600.0
"""Longest quorum or collective timeout: a week; no step waits longer for its peers."""


@dataclass
class FaultToleranceConfig:
    enabled: bool = False
    """Train as one of num_replica_groups replica groups coordinated by a torchft lighthouse:
    each group is its own launch (FSDP/TP inside it as usual), a group that dies is left out
    of the next step and a relaunched group takes the live state from a peer. Off: one
    launch is the whole job, as always. See docs/fault-tolerance.md (Replica groups)."""
    lighthouse: str = ""
    """Address of the lighthouse (http://host:port, started with `kempnerforge lighthouse`);
    empty reads the TORCHFT_LIGHTHOUSE environment variable."""
    replica_group: int = -1
    """This launch's group id, 0 to num_replica_groups - 1; -1 reads the
    KEMPNERFORGE_REPLICA_GROUP environment variable. Each group writes its metrics and
    config under <run dir>/replica_<id>; the checkpoint directory is shared by the job."""
    num_replica_groups: int = 1
    """Groups the job is designed for: it fixes the global batch, num_replica_groups *
    train.grad_accum_steps micro-batches of train.batch_size per data-parallel rank of a
    group, whatever number of groups takes part in a step."""
    min_replica_groups: int = 1
    """Fewest groups a step may commit with; with fewer alive, the groups wait for more
    (up to quorum_timeout_s)."""
    quorum_timeout_s: float = 60.0
    """Seconds a group waits for a quorum (the lighthouse's answer); past it the group
    stops with exit 75, after the group that led the last committed step saved it. At
    most a week."""
    timeout_s: float = 60.0
    """Seconds a cross-group collective, commit vote or live-state transfer may take before
    the step is discarded and redone with the groups still alive; at most a week."""
    participation_window: int = 100
    """Committed steps the replica/participation metric looks back over: the share of
    them whose quorum held all num_replica_groups groups (steps a group missed and healed
    past count as without it). Also the fewest steps between two participation warnings."""
    participation_warn_below: float = 0.9
    """Warn, in one log line, when replica/participation over a full window falls below
    this share (and once more when it is back); 0 never warns. Groups that are all alive
    step together; a lower share means a live group keeps missing quorums (the
    lighthouse's --join-timeout-ms shorter than the groups' spread at the quorum) and
    heals from a peer each time. 0 to 1."""

    def __post_init__(self) -> None:
        check_at_least("fault_tolerance.replica_group", self.replica_group, -1, MAX_SIZE)
        for name in ("num_replica_groups", "min_replica_groups"):
            check_at_least(f"fault_tolerance.{name}", getattr(self, name), 1, MAX_SIZE)
        if self.min_replica_groups > self.num_replica_groups:
            raise ConfigError(
                "fault_tolerance.min_replica_groups",
                self.min_replica_groups,
                f"<= fault_tolerance.num_replica_groups = {self.num_replica_groups}",
            )
        if self.replica_group >= self.num_replica_groups:
            raise ConfigError(
                "fault_tolerance.replica_group",
                self.replica_group,
                f"-1, or 0 to {self.num_replica_groups - 1} (num_replica_groups - 1)",
            )
        check_at_least(
            "fault_tolerance.participation_window", self.participation_window, 1, MAX_SIZE
        )
        check_in_range(
            "fault_tolerance.participation_warn_below", self.participation_warn_below, 0.0, 1.0
        )
        for name in ("quorum_timeout_s", "timeout_s"):
            check_positive(f"fault_tolerance.{name}", getattr(self, name), MAX_TIMEOUT_S)

    def group_id(self) -> int:
        """This launch's group id: replica_group, else the launcher's environment variable."""
        if self.replica_group >= 0:
            return self.replica_group
        text = os.environ.get(REPLICA_GROUP_ENV, "")
        if not text.strip().isdigit() or int(text) >= self.num_replica_groups:
            raise ConfigError(
                "fault_tolerance.replica_group",
                self.replica_group,
                f"a group id 0 to {self.num_replica_groups - 1}, or -1 with {REPLICA_GROUP_ENV} "
                f"set to one (it is {text!r})",
            )
        return int(text)

    def lighthouse_address(self) -> str:
        """The lighthouse to join: lighthouse, else TORCHFT_LIGHTHOUSE."""
        address = self.lighthouse or os.environ.get(LIGHTHOUSE_ENV, "")
        if not address:
            raise ConfigError(
                "fault_tolerance.lighthouse",
                self.lighthouse,
                f"the lighthouse's http://host:port, or {LIGHTHOUSE_ENV} set to it",
                "start one with `kempnerforge lighthouse`",
            )
        return address
