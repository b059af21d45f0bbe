"""Replica groups on torchft ([fault_tolerance]): launches that train one model together and
go on when one of them dies. The quorum's manager, each group's share of a step's batches,
the checkpointer that lets one group write each checkpoint, and what a group does when its
quorum is lost. It wraps the training loop from outside: nothing in training/'s own files
imports it; the train command does."""

from __future__ import annotations

from kempnerforge.training.replicas.groups import ReplicaGroup, checkpointer_kind

__all__ = ["ReplicaGroup", "checkpointer_kind"]
