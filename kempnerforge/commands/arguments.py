"""Arguments that several commands share, spelled and explained once."""

from __future__ import annotations

import argparse

from kempnerforge.config.run_config import RUN_CONFIG_FILE

CHECKPOINT_HELP = (
    "the checkpoint: a step directory (runs/<name>/checkpoints/step_<N>), or the newest "
    "complete one of the checkpoints directory, of its 'latest' file or of a run directory; "
    "or the same in a store: s3://bucket/prefix/step_<N>, the prefix or its 'latest'"
)


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """--checkpoint, required, as every command that loads a model for inference takes it."""
    parser.add_argument("--checkpoint", required=True, help=CHECKPOINT_HELP)


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """--config, optional: where a command that starts from a checkpoint finds its config."""
    parser.add_argument(
        "--config",
        default="",
        help=f"the TOML config the checkpoint was trained with (default: the run directory's "
        f"{RUN_CONFIG_FILE}, else the config the checkpoint recorded when it was saved)",
    )
