"""The rules on the mixture weights in force at each phase, checked by JobConfig.validate:
phase weights name a dataset and leave one on, and the tempered weights stay finite."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from kempnerforge.core.errors import ConfigError, closest_name

if TYPE_CHECKING:
    from kempnerforge.config.job import JobConfig


def check_mixture_weights(config: JobConfig) -> None:
    """The sampler draws source i with probability w_i ** (1 / data.mix_temperature) over
    their sum, for the weights in force at each phase: that must be a finite, non-zero sum
    of finite floats (a low temperature overflows large weights and flushes small ones to
    0)."""
    if not config.data.datasets:
        return
    temperature = config.data.mix_temperature
    in_force = {d.name: float(d.weight) for d in config.data.datasets}
    where = "data.datasets weights"
    for i, phase in enumerate([None, *config.train.phases]):
        if phase is not None:
            in_force.update(phase.dataset_weights)
            where = f"the weights in force from train.phases[{i - 1}]"
        try:
            scaled = [w ** (1.0 / temperature) for w in in_force.values() if w > 0]
        except OverflowError:
            scaled = [math.inf]
        total = sum(scaled)  # inf when it overflows (math.fsum would raise)
        if not (math.isfinite(total) and total > 0):
            raise ConfigError(
                "data.mix_temperature",
                temperature,
                "a temperature for which every weight ** (1 / temperature) and their sum "
                "are finite and not all 0",
                f"{where} are {in_force}",
            )


def check_phase_weights(config: JobConfig) -> None:
    """Phase weights must name mixture datasets and leave some weight on.

    Phases fire in order and each updates the weights in force, so the check follows
    them: a later phase may zero the last source an earlier one left on.
    """
    configured = {d.name: d.weight for d in config.data.datasets}
    in_force = dict(configured)
    for i, phase in enumerate(config.train.phases):
        field = f"train.phases[{i}].dataset_weights"
        if phase.dataset_weights and not configured:
            raise ConfigError(
                field,
                phase.dataset_weights,
                "no weights without a mixture",
                "phase weights need [[data.datasets]]",
            )
        for name in phase.dataset_weights:
            if name not in configured:
                suggestion = closest_name(name, configured)
                raise ConfigError(
                    f"{field}.{name}",
                    name,
                    "a data.datasets name: " + ", ".join(configured),
                    f"did you mean {suggestion!r}?" if suggestion else "",
                )
        in_force.update(phase.dataset_weights)
        if phase.dataset_weights and not any(in_force.values()):
            raise ConfigError(
                field,
                phase.dataset_weights,
                "at least one weight > 0 in force",
                f"after this phase the weights are {in_force}",
            )
