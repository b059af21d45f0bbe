"""PipelineBundle: what a pipeline-parallel step needs from the build phase."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class PipelineBundle:
    """One rank's pipeline stage and the schedule that drives it.

    ``schedule`` is a torch.distributed.pipelining schedule built over ``stage``;
    ``group`` is the pipeline process group the last stage broadcasts the loss over.
    """

    stage: Any
    schedule: Any
    pp_rank: int
    pp_size: int
    group: Any = None

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1
