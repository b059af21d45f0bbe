"""Loading a checkpoint's model for inference: the one way eval, generate, capture and export
find a checkpoint and its config, refuse what the model family cannot do, and build the
model with the checkpoint's weights in one process.

Two steps, so a command checks its own cheap inputs (its data, its prompt, the export's
architecture) between them, before the model is built: open_for_inference finds and checks,
load_for_inference builds and loads.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import tomllib
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomli_w
import torch

from kempnerforge.checkpoint.choice import choose
from kempnerforge.checkpoint.disk_format import DCP_METADATA, LATEST, MARKER, STEP_DIR, step_dirs
from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.checkpoint.store import CheckpointStoreError
from kempnerforge.checkpoint.store_reads import split_store_url
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.config.run_config import RUN_CONFIG_FILE, run_config_of_checkpoints
from kempnerforge.core.errors import CheckpointError, ConfigError
from kempnerforge.core.logging import get_logger
from kempnerforge.distributed.runtime import RuntimeContext, init_runtime, world_size_from_env
from kempnerforge.model.lora import add_adapters, merge_lora
from kempnerforge.model.meta import on_meta
from kempnerforge.storage.files import write_file
from kempnerforge.storage.location import is_store_url, join
from kempnerforge.training.families import family_of

logger = get_logger(__name__)

CHECKPOINTS_DIR = "checkpoints"
"""The run directory's folder of checkpoints (JobConfig.checkpoint_dir by default)."""

CHECKPOINT_FORMS = (
    "pass a checkpoint (runs/<name>/checkpoints/step_<N>), its checkpoints directory or the "
    f"'{LATEST}' file there, the run directory, or a store URL (s3://bucket/prefix/step_<N>, "
    f"the prefix, or its '{LATEST}')"
)
"""What --checkpoint accepts, for the errors that say it was none of them."""


@dataclass(frozen=True)
class InferenceJob:
    """A complete checkpoint and the config to rebuild its model, checked for one command
    in one process; nothing built yet (load_for_inference builds the model)."""

    command: str
    checkpoint: Path
    """The checkpoint used (a step_<N> directory; a store's: its staged copy), found
    complete."""
    source: str
    """Where the checkpoint lives, as reports name it: its directory, or its URL."""
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
    or a run directory (its checkpoints where its config.toml's checkpoint.dir says, a
    store included), or a store URL: a checkpoint, a checkpoints prefix or its ``latest``.
    All but a step give the newest complete checkpoint there, as a resume would choose it
    (``latest`` if complete, else the newest complete step_<N>). A checkpoint in a store
    is fetched into a temporary folder (removed when the process ends): only its own
    files, those its check and load read. The config is ``config_path`` when given, else
    the run directory's config.toml, else the config the checkpoint recorded;
    ``overrides`` apply on top. ``validate`` checks the config's cross-section rules for
    one process (a command that reads no data may skip them, so the [distributed] layout
    of a multi-process run need not fit one process). ``device`` overrides train.device.
    Logs one line naming the checkpoint and the config.

    Each checkpoint is checked once (every file read, checksums compared); the load that
    follows trusts that verdict. Config problems are found before that pass whenever the
    config does not have to come from the checkpoint.
    """
    # An explicit config is read first: its mistakes are cheaper to find than the checkpoint.
    config = load_config(config_path, overrides) if config_path else None
    source = config_path
    if config is not None:
        _check(config, command, source, validate)
    location = locate_checkpoint(checkpoint)
    run_config = location.run_config
    if config is None and run_config is not None and run_config.is_file():
        config, source = load_config(str(run_config), overrides), str(run_config)
        _check(config, command, source, validate)
    checkpointer = _checkpointer(location.directory, config)

    skipped: list[str] = []
    chosen = _chosen(checkpointer, location, skipped)
    where = checkpointer.location_of(chosen)
    extra = checkpointer.read_extra(str(chosen))  # a CheckpointError when incomplete
    recorded = extra.get("config") if isinstance(extra.get("config"), dict) else None
    if config is None:
        config, source = _recorded_config(recorded, overrides, where, run_config)
        _check(config, command, source, validate)

    step = extra.get("step")
    found = ""
    if location.named is None:
        also = f"; skipped {'; '.join(skipped)}" if skipped else ""
        found = f" (the newest complete checkpoint in {location.directory}{also})"
    logger.info("%s: step %s of %s%s; config: %s", command, step, where, found, source)
    if config.train.num_threads:
        torch.set_num_threads(config.train.num_threads)
    return InferenceJob(
        command=command,
        checkpoint=chosen,
        source=where,
        step=step if isinstance(step, int) else None,
        config=config,
        config_source=source,
        recorded_config=recorded,
        runtime=init_runtime(config.distributed, device or config.train.device),
        checkpointer=checkpointer,
    )


def output_path(job: InferenceJob, given: str, name: str) -> str:
    """Where a command writes its output: ``given``, else the file ``name`` beside the
    checkpoint's own files (in its store, for a checkpoint in one)."""
    return given or join(job.source, name)


def write_output(path: str, write: Callable[[str], None]) -> None:
    """Have ``write(local path)`` write the output ``path`` (a store URL: uploaded from a
    temporary file), creating a local path's directory first."""
    if not is_store_url(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_file(path, write)


def load_for_inference(job: InferenceJob, *, keep_adapters: bool = False) -> torch.nn.Module:
    """The model of ``job`` on its device with the checkpoint's weights, in eval mode.

    A run trained with [lora] adapters is built with them, loaded, and (unless
    ``keep_adapters``, for exporting the adapters themselves) merged into its projections.

    Built on the meta device and materialised once on the device, without drawing the
    weights the load overwrites; then a weights-only load (CheckpointManager.load_weights:
    no optimizer, scheduler, train state or RNG is read).
    """
    family = family_of(job.config)
    with on_meta():
        model = family.build_model(job.config)
        add_adapters(model, job.config.lora)
    model.to_empty(device=job.runtime.device)
    family.fill_unsaved(model)  # only what the checkpoint does not hold
    job.checkpointer.load_weights(str(job.checkpoint), model=model)
    if not keep_adapters:
        merge_lora(model)  # one projection per layer again: the trained function, cheaper
    return model.eval()


@dataclass(frozen=True)
class CheckpointLocation:
    """Where --checkpoint points."""

    directory: str
    """The directory of checkpoints, or their prefix in a store."""
    named: str | None
    """The checkpoint given (a step_<N> directory, or its URL); None: the newest complete
    one in ``directory``."""
    run_config: Path | None
    """The run's config.toml, when its run directory is known (it may not exist)."""


def locate_checkpoint(given: str) -> CheckpointLocation:
    """Where ``given`` points. Reads directory listings and a run's config.toml only, and
    nothing of a store; a CheckpointError naming ``given`` when it holds no checkpoint."""
    if is_store_url(given):
        prefix, name = split_store_url(given)
        return CheckpointLocation(prefix, join(prefix, name) if name else None, None)
    path = Path(given)
    if path.name == LATEST and path.is_file():
        return CheckpointLocation(str(path.parent), None, run_config_of_checkpoints(path.parent))
    if not path.is_dir():
        problem = "is not a directory" if path.exists() else "does not exist"
        raise CheckpointError(path, f"{problem}; {CHECKPOINT_FORMS}")
    if STEP_DIR.fullmatch(path.name) or (path / MARKER).exists() or (path / DCP_METADATA).exists():
        directory = Path(os.path.abspath(path)).parent  # absolute: "." has no parent
        return CheckpointLocation(str(directory), str(path), run_config_of_checkpoints(directory))
    for directory in (path, path / CHECKPOINTS_DIR):
        if _holds_checkpoints(directory):
            return CheckpointLocation(str(directory), None, run_config_of_checkpoints(directory))
    elsewhere = _checkpoint_dir_of_run(path)
    if is_store_url(elsewhere) or (elsewhere and _holds_checkpoints(Path(elsewhere))):
        return CheckpointLocation(elsewhere.rstrip("/"), None, path / RUN_CONFIG_FILE)
    raise CheckpointError(path, f"holds no checkpoint; {CHECKPOINT_FORMS}")


def _holds_checkpoints(directory: Path) -> bool:
    return directory.is_dir() and ((directory / LATEST).exists() or bool(step_dirs(directory)))


def _checkpoint_dir_of_run(run_dir: Path) -> str:
    """checkpoint.dir as the config.toml of the run directory `run_dir` records it; ''
    when it records none (or there is no readable config.toml)."""
    try:
        recorded = tomllib.loads((run_dir / RUN_CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return ""
    section = recorded.get("checkpoint")
    value = section.get("dir") if isinstance(section, dict) else None
    return value if isinstance(value, str) else ""


def _checkpointer(directory: str, config: JobConfig | None) -> CheckpointManager:
    """The manager that reads the checkpoints of `directory`. Those of a store are staged
    in a new temporary folder, inside checkpoint.staging_dir when the config sets one
    that exists here (else the system's temporary directory), removed when the manager is
    gone (at the latest when the process ends); the config's store_timeout_s and
    store_connections apply."""
    cfg = config.checkpoint if config is not None else CheckpointConfig()
    if not is_store_url(directory):
        return CheckpointManager(CheckpointConfig(), directory)
    try:
        staging = tempfile.mkdtemp(prefix="kempnerforge-fetch-", dir=cfg.staging_dir or None)
    except OSError:  # the training job's staging folder need not exist where this runs
        staging = tempfile.mkdtemp(prefix="kempnerforge-fetch-")
    checkpointer = CheckpointManager(cfg, directory, staging_dir=staging)
    weakref.finalize(checkpointer, shutil.rmtree, staging, True)
    return checkpointer


def _chosen(
    checkpointer: CheckpointManager, location: CheckpointLocation, skipped: list[str]
) -> Path:
    """The checkpoint to load (its staged copy, for a store's): the one named, or the one
    a resume of the directory would take (checkpoint/choice.py), each candidate checked
    by ``checkpointer`` (so the load checks it no more); the ones found broken are
    appended to ``skipped``."""
    candidates = checkpointer.candidates(location.named or "auto")
    assert candidates is not None  # only "none" lists nothing
    if candidates.explicit is not None:
        return candidates.explicit

    def verdict(path: Path) -> list[str]:
        problems = checkpointer.verify(path)
        if problems:
            skipped.append(f"{path.name} ({problems[0]})")
        return problems

    try:
        chosen = choose(candidates, verdict, quiet=True)
    except CheckpointStoreError:
        raise  # the store failed: nothing is known of its checkpoints
    except CheckpointError:
        chosen = None  # only broken checkpoints: said below, without the resume advice
    if chosen is None:
        found = f" (skipped {'; '.join(skipped)})" if skipped else ""
        raise CheckpointError(location.directory, f"holds no complete checkpoint{found}")
    return Path(chosen)


def _recorded_config(
    recorded: dict[str, Any] | None,
    overrides: Sequence[str],
    checkpoint: str,
    run_config: Path | None,
) -> tuple[JobConfig, str]:
    """The config ``checkpoint`` recorded at save time with ``overrides``, and its source;
    a ConfigError asking for --config when it records none."""
    if recorded is None:
        none_beside = f"{run_config} does not exist and " if run_config is not None else ""
        raise ConfigError(
            "--config",
            "",
            "the TOML config of the run that saved the checkpoint",
            f"{none_beside}{checkpoint} records no config",
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
