"""Errors that end a multi-process run because of another rank (no torch import: the CLI
catches them)."""

from __future__ import annotations


class PeerSetupError(Exception):
    """Rank 0 could not take the run's directories (a refused directory, a held lock); the
    other ranks stop with its reason instead of waiting for it."""


class CollectiveFailure(Exception):
    """A collective failed because a peer died or hung; the message names the collective,
    this rank and the unresponsive ranks (see kempnerforge.distributed.failure)."""
