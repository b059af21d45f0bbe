"""Where a run directory keeps the config it was trained with.

Training writes it (training/workspace.py); the commands that start from a checkpoint
(generate, capture, export) read it back. They import no torch at module level, so the
name and the lookup live here rather than beside the training workspace.
"""

from __future__ import annotations

from pathlib import Path

RUN_CONFIG_FILE = "config.toml"
"""The run's config, at the top of its run directory."""


def run_config_beside(checkpoint: str | Path) -> Path:
    """``<run_dir>/config.toml`` for a checkpoint at ``<run_dir>/checkpoints/step_<N>``.

    Resolved from the absolute path, so a relative ``step_<N>`` given from inside the
    checkpoints directory finds its run too. The file may not exist; callers say what to do.
    """
    return Path(checkpoint).absolute().parent.parent / RUN_CONFIG_FILE
