"""Every parallel layout of a config up to a number of processes, and which of them the
job's own validation refuses (`kempnerforge check-parallel CONFIG --layouts all`).

A layout rule is proven by running it, not by reading it: the sweep enumerates the mesh
degrees, pipeline schedules and expert-parallel degrees, asks the same checks a launch
runs (JobConfig.validate for the world size, then preflight) which of them a launch would
refuse, and leaves the others for check-parallel to train against one process.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kempnerforge.config.distributed import MESH_DIMS, PP_SCHEDULES
from kempnerforge.core.errors import ConfigError
from kempnerforge.launch.parallel_check import Layout

ALL_LAYOUTS = "all"
"""The --layouts value that sweeps every layout up to --nproc processes."""
DEFAULT_SWEEP_NPROC = 4
"""Largest world size of a sweep when --nproc is not given."""


def layout_text(degrees: dict[str, int], schedule: str = "") -> str:
    """'pp=2,dp_shard=2,ep=2,schedule=zbv': the degrees above 1, in mesh order, then ep, the
    ring and the schedule; parse_layout reads it back."""
    items = [f"{key}={value}" for key, value in degrees.items() if value > 1]
    if schedule:
        items.append(f"schedule={schedule}")
    return ",".join(items)


def mesh_degrees(max_world: int) -> list[dict[str, int]]:
    """Every assignment of degrees to the five mesh dimensions whose product (the world
    size) is 2 to ``max_world``, smaller worlds first."""
    meshes = []
    for world in range(2, max_world + 1):
        for values in itertools.product(range(1, world + 1), repeat=len(MESH_DIMS)):
            if math.prod(values) == world:
                meshes.append(dict(zip(MESH_DIMS, values, strict=True)))
    return meshes


def sweep_layouts(max_world: int, moe: bool) -> list[Layout]:
    """The layouts a sweep considers: every mesh of 2 to ``max_world`` processes, each
    pipeline mesh once per schedule, for a Mixture-of-Experts model each expert-parallel
    degree from 1 to the mesh's dp_shard * cp ranks (validation refuses the ones that do
    not divide), and with context parallelism the config's own cp attention and each ring
    of 2 or more ranks that divides cp (cp / ring Ulysses ranks in each)."""
    layouts = []
    for degrees in mesh_degrees(max_world):
        schedules = PP_SCHEDULES if degrees["pp"] > 1 else ("",)
        eps = range(1, degrees["dp_shard"] * degrees["cp"] + 1) if moe else (1,)
        cp = degrees["cp"]
        rings = [0, *(ring for ring in range(2, cp + 1) if cp % ring == 0)]
        for ep, ring, schedule in itertools.product(eps, rings, schedules):
            named = {**degrees, "ep": ep, "ring": ring}
            layouts.append(Layout(layout_text(named, schedule), **named, schedule=schedule))
    return layouts


@dataclass(frozen=True)
class Refusal:
    """Why a launch would refuse a layout: the config field its error names, and the line."""

    layout: Layout
    field: str
    message: str


def refusal_of(layout: Layout, check: Callable[[Layout], None]) -> Refusal | None:
    """Run ``check`` (a launch's checks for this layout); the ConfigError it raises as a
    Refusal, or None when the layout would start."""
    try:
        check(layout)
    except ConfigError as e:
        return Refusal(layout, e.field, str(e))
    return None


def format_refusals(refusals: Sequence[Refusal]) -> str:
    """One line per refused layout: the layout, its world size and the launch's own error."""
    return "\n".join(
        f"{r.layout.text} ({r.layout.world_size} processes): REFUSED {r.message}" for r in refusals
    )
