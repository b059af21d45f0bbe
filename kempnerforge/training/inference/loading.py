"""Loading a checkpoint's model for inference: the one way eval, generate, capture and export
find a checkpoint and its config, refuse what the model family cannot do, and build the
model with the checkpoint's weights in one process.

Two steps, so a command checks its own cheap inputs (its data, its prompt, the export's
architecture) between them, before the model is built: open_for_inference finds and checks,
load_for_inference builds and loads.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch

from kempnerforge.checkpoint.choice import choose, list_candidates
from kempnerforge.checkpoint.disk_format import DCP_METADATA, LATEST, MARKER, STEP_DIR, step_dirs
from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.run_config import RUN_CONFIG_FILE, run_config_of_checkpoints
from kempnerforge.core.errors import CheckpointError, ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.runtime import RuntimeContext, init_runtime, world_size_from_env
from kempnerforge.training.families import family_of

logger = get_logger(__name__)

CHECKPOINTS_DIR = "checkpoints"
"""The run directory's folder of checkpoints (JobConfig.checkpoint_dir by default)."""

CHECKPOINT_FORMS = (
    "pass a checkpoint (runs/<name>/checkpoints/step_<N>), its checkpoints directory or the "
    f"'{LATEST}' file there, or the run directory"
)
"""What --checkpoint accepts, for the errors that say it was none of them."""


@dataclass(frozen=True)
class InferenceJob:
    """A complete checkpoint and the config to rebuild its model, checked for one command
    in one process; nothing built yet (load_for_inference builds the model)."""

    command: str
    checkpoint: Path
    """The checkpoint used (a step_<N> directory), found complete."""
    step: int | None
    """The step it was saved at; None for a checkpoint that records none."""
    config: JobConfig
    """The run's config, with the command's overrides, checked for this command."""
    config_source: str
    """Where ``config`` came from: a TOML path, or the config recorded in the checkpoint."""
    recorded_config: dict[str, Any] | None
    """The config the checkpoint recorded when it was saved; None when it records none."""
    runtime: RuntimeContext
    """One process: its device is train.device unless the command chose one."""
    checkpointer: CheckpointManager
    """Reads the checkpoint; it found it complete already, so the load checks nothing twice."""


def open_for_inference(
    command: str,
    checkpoint: str,
    *,
    config_path: str = "",
    overrides: Sequence[str] = (),
    validate: bool = True,
    device: str = "",
) -> InferenceJob:
    """Find the checkpoint ``checkpoint`` names and the config of its run, and check both
    for ``command`` in this one process; build nothing.

    ``checkpoint`` is a step_<N> directory, a checkpoints directory or its ``latest`` file,
    or a run directory: the last three give the newest complete checkpoint there, as a
    resume would choose it (``latest`` if complete, else the newest complete step_<N>).
    The config is ``config_path`` when given, else the run directory's config.toml, else
    the config the checkpoint recorded; ``overrides`` apply on top. ``validate`` checks the
    config's cross-section rules for one process (a command that reads no data may skip
    them, so the [distributed] layout of a multi-process run need not fit one process).
    ``device`` overrides train.device. Logs one line naming the checkpoint and the config.

    Each checkpoint is checked once (every file read, checksums compared); the load that
    follows trusts that verdict. Config problems are found before that pass whenever the
    config does not have to come from the checkpoint.
    """
    # An explicit config is read first: its mistakes are cheaper to find than the checkpoint.
    config = load_config(config_path, overrides) if config_path else None
    source = config_path
    if config is not None:
        _check(config, command, source, validate)
    directory, named = locate_checkpoint(checkpoint)
    checkpointer = CheckpointManager(CheckpointConfig(), str(directory))
    run_config = run_config_of_checkpoints(directory)
    if config is None and run_config.is_file():
        config, source = load_config(str(run_config), overrides), str(run_config)
        _check(config, command, source, validate)

    skipped: list[str] = []
    chosen = named if named is not None else _newest_complete(checkpointer, directory, skipped)
    extra = checkpointer.read_extra(str(chosen))  # a CheckpointError when incomplete
    recorded = extra.get("config") if isinstance(extra.get("config"), dict) else None
    if config is None:
        config, source = _recorded_config(recorded, overrides, chosen, run_config)
        _check(config, command, source, validate)

    step = extra.get("step")
    found = ""
    if named is None:
        also = f"; skipped {'; '.join(skipped)}" if skipped else ""
        found = f" (the newest complete checkpoint in {directory}{also})"
    logger.info("%s: step %s of %s%s; config: %s", command, step, chosen, found, source)
    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    return InferenceJob(
        command=command,
        checkpoint=chosen,
        step=step if isinstance(step, int) else None,
        config=config,
        config_source=source,
        recorded_config=recorded,
        runtime=init_runtime(config.distributed, device or config.train.device),
        checkpointer=checkpointer,
    )


def load_for_inference(job: InferenceJob) -> torch.nn.Module:
    """The model of ``job`` on its device with the checkpoint's weights, in eval mode.

    Built on the meta device and materialised once on the device, without drawing the
    weights the load overwrites; then a weights-only load (CheckpointManager.load_weights:
    no optimizer, scheduler, train state or RNG is read).
    """
    family = family_of(job.config)
    with torch.device("meta"):
        model = family.build_model(job.config)
    model.to_empty(device=job.runtime.device)
    family.fill_unsaved(model)  # only what the checkpoint does not hold
    job.checkpointer.load_weights(str(job.checkpoint), model=model)
    return model.eval()


def locate_checkpoint(given: str) -> tuple[Path, Path | None]:
    """Where ``given`` points: (the directory of checkpoints, the checkpoint it names), the
    second None when the newest complete checkpoint there is meant. Reads directory
    listings only; a CheckpointError naming ``given`` when it holds no checkpoint."""
    path = Path(given)
    if path.name == LATEST and path.is_file():
        return path.parent, None
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(path, f"{problem}; {CHECKPOINT_FORMS}")
    if STEP_DIR.fullmatch(path.name) or (path / MARKER).exists() or (path / DCP_METADATA).exists():
        return Path(os.path.abspath(path)).parent, path  # absolute: "." has no parent
    for directory in (path, path / CHECKPOINTS_DIR):
        if directory.is_dir() and ((directory / LATEST).exists() or step_dirs(directory)):
            return directory, None
    raise CheckpointError(path, f"holds no checkpoint; {CHECKPOINT_FORMS}")


def _newest_complete(checkpointer: CheckpointManager, directory: Path, skipped: list[str]) -> Path:
    """The checkpoint a resume of ``directory`` would take (checkpoint/choice.py), each
    candidate checked by ``checkpointer`` (so the load checks it no more); the ones found
    broken are appended to ``skipped``."""

    def verdict(path: Path) -> list[str]:
        problems = checkpointer.verify(path)
        if problems:
            skipped.append(f"{path.name} ({problems[0]})")
        return problems

    candidates = list_candidates(directory, "auto")
    assert candidates is not None  # only "none" lists nothing
    try:
        chosen = choose(candidates, verdict, quiet=True)
    except CheckpointError:
        chosen = None  # only broken checkpoints: said below, without the resume advice
    if chosen is None:
        found = f" (skipped {'; '.join(skipped)})" if skipped else ""
        raise CheckpointError(directory, f"holds no complete checkpoint{found}")
    return Path(chosen)


def _recorded_config(
    recorded: dict[str, Any] | None, overrides: Sequence[str], checkpoint: Path, run_config: Path
) -> tuple[JobConfig, str]:
    """The config ``checkpoint`` recorded at save time with ``overrides``, and its source;
    a ConfigError asking for --config when it records none."""
    if recorded is None:
        raise ConfigError(
            "--config",
            "",
            "the TOML config of the run that saved the checkpoint",
            f"{run_config} does not exist and {checkpoint} records no config",
        )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, RUN_CONFIG_FILE)
        with open(path, "w") as f:
            f.write(tomli_w.dumps(recorded))
        config = load_config(path, overrides)
    return config, f"the config recorded in {checkpoint}"


def _check(config: JobConfig, command: str, source: str, validate: bool) -> None:
    """Refuse a model family ``command`` cannot run, a launch of several processes, and
    (``validate``) a config whose cross-section rules fail in one process."""
    reason = family_of(config).refusal(command)
    if reason is not None:
        error = ConfigError("<model family>", source, f"a model {command} takes", reason)
        error.args = (f"{source}: {reason}",)  # one line: the config and why
        raise error
    world_size = world_size_from_env()
    if world_size > 1:
        raise ConfigError(
            "WORLD_SIZE", world_size, f"1: kempnerforge {command} runs in one process"
        )
    if validate:
        config.validate(1)
