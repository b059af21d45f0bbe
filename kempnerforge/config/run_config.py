"""Where a run directory keeps the config it was trained with.

Training writes it (training/workspace.py); loading a checkpoint for inference
(training/inference/loading.py: eval, generate, capture, export) reads it back. Nothing here
imports torch, so the name and the lookup live here rather than beside the training
workspace.
"""

from __future__ import annotations

import os
from pathlib import Path

RUN_CONFIG_FILE = "config.toml"
"""The run's config, at the top of its run directory."""


def run_config_beside(checkpoint: str | Path) -> Path:
    """``<run_dir>/config.toml`` for a checkpoint at ``<run_dir>/checkpoints/step_<N>``.

    Resolved from the absolute path, so a relative ``step_<N>`` (or ``.``, ``..``) given
    from inside the run finds its run too. The file may not exist; callers say what to do.
    """
    return run_config_of_checkpoints(Path(os.path.abspath(checkpoint)).parent)


def run_config_of_checkpoints(directory: str | Path) -> Path:
    """``<run_dir>/config.toml`` for the checkpoints directory ``<run_dir>/checkpoints``,
    resolved as run_config_beside resolves a checkpoint."""
    return Path(os.path.abspath(directory)).parent / RUN_CONFIG_FILE
