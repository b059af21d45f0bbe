"""Resilience: skipping non-finite steps, stopping cleanly on signals, exit codes."""

from kempnerforge.resilience import exit_codes
from kempnerforge.resilience.nan import NaNAbortError, NaNDetector
from kempnerforge.resilience.shutdown import ShutdownHandler

__all__ = ["NaNAbortError", "NaNDetector", "ShutdownHandler", "exit_codes"]
