"""Mixture-of-Experts: the routed feed-forward, its experts, expert parallelism's token exchange,
and the training step's side of the routers (losses, statistics, pipeline stages).

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.model.moe.layer import MoEFeedForward, Router, moe_layers
from kempnerforge.model.moe.router_stage import attach_stage_router_hooks, record_stage_router_stats
from kempnerforge.model.moe.router_step import (
    add_micro_batch_router_losses,
    add_router_losses,
    begin_router_step,
    finish_router_step,
    record_router_stats,
    sum_step_totals,
)

__all__ = [
    "MoEFeedForward",
    "Router",
    "add_micro_batch_router_losses",
    "add_router_losses",
    "attach_stage_router_hooks",
    "begin_router_step",
    "finish_router_step",
    "moe_layers",
    "record_router_stats",
    "record_stage_router_stats",
    "sum_step_totals",
]
