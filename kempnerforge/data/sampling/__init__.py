"""The data order: the keyed permutation, each rank's sampler, mixtures of datasets drawn by
weight, and the windows each replica group reads in a step.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.data.sampling.mixture import MixtureDataset, MixtureSampler
from kempnerforge.data.sampling.pairs import PairSampler
from kempnerforge.data.sampling.sampler import ShardedSampler
from kempnerforge.data.sampling.step_slots import StepSlots, assigned_slots

__all__ = [
    "MixtureDataset",
    "MixtureSampler",
    "PairSampler",
    "ShardedSampler",
    "StepSlots",
    "assigned_slots",
]
