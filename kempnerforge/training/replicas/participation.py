"""How often the replica groups step together: each group's share of the job's recent
committed steps whose quorum held every group the job has, and how often it healed.

Groups that are all alive should all be in every quorum. One that misses a quorum (it
reached the lighthouse after the join timeout) falls behind, takes a peer's live state
and rejoins: no step is lost, but its compute for the missed steps is, and the live state
crosses the network each time. Nothing fails, so only these numbers show it. They come
from what every group already knows (its quorum's size, its own heals): no collective.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

PARTICIPATION_KEY = "replica/participation"
"""Metrics column: the share of the window's committed steps whose quorum held every
group the job has (fault_tolerance.num_replica_groups)."""
HEALS_KEY = "replica/heals_per_hour"
"""Metrics column: this group's heals (replica_rejoined) in the last hour, per hour."""

_HOUR_S = 3600.0


class Participation:
    """One group's record of the job's last ``window`` committed steps and its own heals.

    A step counts as whole when its quorum held all ``num_groups`` groups. The steps a
    group missed (committed by its peers while it was behind, then skipped by its heal)
    count too, as not whole: from the missing group's own record they would be invisible.
    Every group thus sees the same share whichever one keeps missing. A dead group lowers
    it as well, which is right: the job then runs without it.

    ``warn_below`` makes ``record`` return one line when the share, over a full window,
    falls below it, and one when it is back at or above it; a change of state is taken at
    most once per window of steps, so a share hovering at the threshold logs at most one
    line per window, never one per step. 0 turns the lines off.
    """

    def __init__(
        self,
        num_groups: int,
        window: int,
        warn_below: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_groups = num_groups
        self.window = window
        self.warn_below = warn_below
        self._clock = clock
        self._whole: collections.deque[bool] = collections.deque(maxlen=window)
        self._heals: collections.deque[float] = collections.deque()
        self._started = clock()
        self._below = False
        self._steps_since_change = 0

    def share(self) -> float | None:
        """Share of the window's steps (fewer at the start) whose quorum held every group;
        None before the first."""
        if not self._whole:
            return None
        return sum(self._whole) / len(self._whole)

    def heals_per_hour(self) -> float:
        """Heals in the last hour per hour (over the time since the start while it is
        shorter than an hour)."""
        now = self._clock()
        while self._heals and now - self._heals[0] > _HOUR_S:
            self._heals.popleft()
        span = min(_HOUR_S, max(now - self._started, 1e-9))
        return len(self._heals) * _HOUR_S / span

    def healed(self, missed_steps: int) -> None:
        """This group took a peer's live state mid-run, ``missed_steps`` steps behind: those
        steps were committed without it."""
        self._heals.append(self._clock())
        for _ in range(max(0, missed_steps)):
            self._add(False)

    def record(self, participants: int) -> str | None:
        """A committed step with ``participants`` groups in its quorum; the line to log
        when the share just crossed ``warn_below`` (see the class), else None."""
        self._add(participants >= self.num_groups)
        share = self.share()
        if self.warn_below <= 0 or share is None or len(self._whole) < self.window:
            return None
        if self._steps_since_change < self.window:
            return None
        if not self._below and share < self.warn_below:
            self._below, self._steps_since_change = True, 0
            return (
                f"only {share:.0%} of the last {self.window} steps had all {self.num_groups} "
                f"replica groups in their quorum (fault_tolerance.participation_warn_below "
                f"= {self.warn_below:g}): a group that is alive but misses quorums heals "
                "from a peer each time; raise the lighthouse's --join-timeout-ms above the "
                "groups' step time (docs/fault-tolerance.md, Replica groups)"
            )
        if self._below and share >= self.warn_below:
            self._below, self._steps_since_change = False, 0
            return (
                f"{share:.0%} of the last {self.window} steps had all {self.num_groups} "
                "replica groups in their quorum again"
            )
        return None

    def row(self) -> dict[str, float]:
        """The metrics columns (PARTICIPATION_KEY, HEALS_KEY); none before the first step."""
        share = self.share()
        if share is None:
            return {}
        return {PARTICIPATION_KEY: share, HEALS_KEY: self.heals_per_hour()}

    def _add(self, whole: bool) -> None:
        self._whole.append(whole)
        self._steps_since_change += 1
