"""The base of Lion, Muon and schedule-free AdamW: the ``foreach`` group option, a step()
that runs the closure and then steps each parameter group, and per-parameter state created
on first use, written once for all three."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


class ForeachOptimizer(torch.optim.Optimizer):
    """An optimizer that steps one parameter group at a time, loop or foreach per group.

    ``foreach`` joins the defaults as the group option every subclass reads through
    use_foreach(). A subclass supplies _group_step(); step() runs the closure with
    gradients enabled and steps each group in order.
    """

    def __init__(
        self, params: Iterable[Any], defaults: dict[str, Any], foreach: bool | None
    ) -> None:
        super().__init__(params, {**defaults, "foreach": foreach})

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # state dicts saved before the switch existed
            group.setdefault("foreach", None)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._group_step(group)
        return loss

    def _group_step(self, group: dict[str, Any]) -> None:
        """Update the group's parameters that have a gradient, and their state."""
        raise NotImplementedError

    def _states(
        self, params: list[torch.Tensor], fresh: Callable[[torch.Tensor], dict[str, torch.Tensor]]
    ) -> list[dict[str, Any]]:
        """Each parameter's state, filled with ``fresh(p)`` the first time it is asked for:
        a parameter that never has a gradient never gets state."""
        states = []
        for p in params:
            state = self.state[p]
            if not state:
                state.update(fresh(p))
            states.append(state)
        return states
