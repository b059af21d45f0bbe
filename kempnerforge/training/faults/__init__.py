"""Faults within one launch: a bad step's attribution (bad data, a spike, a suspected
hardware fault, by running the step again), the rollback to the last checkpoint after
non-finite losses, and checkpoint saves that fail without ending the run (and a save in
flight drained while another error ends it). The loop calls
these and nothing else in training/ does; replica groups and the commands never do."""

from __future__ import annotations

from kempnerforge.training.faults.attribution import attempt_step
from kempnerforge.training.faults.rollback import roll_back_or_stop
from kempnerforge.training.faults.save_failures import (
    drain_after_failure,
    tolerating_failed_saves,
)

__all__ = [
    "attempt_step",
    "drain_after_failure",
    "roll_back_or_stop",
    "tolerating_failed_saves",
]
