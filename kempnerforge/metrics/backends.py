"""Optional metric backends beside metrics.jsonl and the console: TensorBoard and Weights &
Biases, chosen in ``metrics.backends`` and imported only when chosen.

A backend receives the numeric values of every training and eval row the tracker writes
(events stay in metrics.jsonl), keyed by step. metrics.jsonl remains the record a run is
resumed and plotted from; a backend is a view of it.
"""

from __future__ import annotations

import hashlib
import math
import os
from typing import Any, Protocol

from kempnerforge.config.metrics import MetricsConfig
from kempnerforge.core.errors import ConfigError

TENSORBOARD_DIR = "tensorboard"
"""Event files go to <run_dir>/tensorboard."""


class MetricBackend(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None:
        """Record ``values`` (finite floats) at ``step``."""
        ...

    def close(self) -> None:
        """Flush and release; called once, at the end of the run."""
        ...


def scalar_values(row: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a metrics row, without its step and wall time."""
    values: dict[str, float] = {}
    for key, value in row.items():
        if key in ("step", "time") or isinstance(value, bool):
            continue
        if isinstance(value, int | float) and math.isfinite(value):
            values[key] = float(value)
    return values


class TensorBoardBackend:
    """Scalars through torch.utils.tensorboard's SummaryWriter, one tag per metric."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "metrics.backends",
                "tensorboard",
                "a backend whose package is installed",
                "pip install 'kempnerforge[tensorboard]'",
            ) from None
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    """A Weights & Biases run, offline by default (no account or network needed: the run
    is written under <run_dir>/wandb and can be uploaded later with ``wandb sync``).

    The W&B run id is derived from the run directory, so a resumed launch continues the
    same W&B run.
    """

    def __init__(self, cfg: MetricsConfig, run_dir: str, name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "metrics.backends",
                "wandb",
                "a backend whose package is installed",
                "pip install 'kempnerforge[wandb]'",
            ) from None
        run_id = hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:16]
        self._run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            name=name,
            id=run_id,
            resume="allow",
            dir=run_dir,
            mode=cfg.wandb_mode,  # pyright: ignore[reportArgumentType]  (checked in MetricsConfig)
            config=config,
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def build_backends(
    cfg: MetricsConfig, run_dir: str, *, name: str, config: dict[str, Any] | None = None
) -> list[MetricBackend]:
    """The backends ``cfg.backends`` names, in order; [] when it names none.

    ``config`` (the resolved job config as a dict) is recorded with a W&B run.
    """
    backends: list[MetricBackend] = []
    for backend in cfg.backends:
        if backend == "tensorboard":
            backends.append(TensorBoardBackend(os.path.join(run_dir, TENSORBOARD_DIR)))
        elif backend == "wandb":
            backends.append(WandbBackend(cfg, run_dir, name, config or {}))
    return backends
