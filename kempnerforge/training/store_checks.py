"""Start-up checks of the paths a job names in object stores: the stores it reads are asked
once, so a missing bucket, refused credentials or an unreachable endpoint stop the launch
before anything is built; a checkpoint.dir in a store is written to once (the job must be
able to write there); and a run directory in a store is refused."""

from __future__ import annotations

import uuid

from kempnerforge.checkpoint.store import TIMEOUT_FIELD
from kempnerforge.checkpoint.store_saves import DEADLINES_PER_SAVE
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.data import DataConfig
from kempnerforge.config.eval import EvalConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.resilience.hang import CHECKPOINT, FLOOR_S
from kempnerforge.storage.deadlines import Deadline
from kempnerforge.storage.files import probe, remove, write_bytes
from kempnerforge.storage.location import is_store_url, join
from kempnerforge.storage.stores import StoreError

LOCAL_ONLY = "a local or mounted directory"
LOCAL_ONLY_WHY = (
    "a run directory holds the run's lock, config and metrics and must be local or a store "
    "mounted as a directory; object stores work for data paths and checkpoint.dir"
)


def data_urls(data: DataConfig, ec: EvalConfig) -> list[tuple[str, str]]:
    """(config field, URL) of every data path the job reads from an object store."""
    named = [("data.path", data.path), ("data.eval_path", data.eval_path)]
    named += [(f"data.datasets[{i}].path", s.path) for i, s in enumerate(data.datasets)]
    named += [(f"eval.sets[{i}].path", s.path) for i, s in enumerate(ec.sets)]
    return [(field, path) for field, path in named if path and is_store_url(path)]


def check_local_dirs(train: TrainConfig) -> None:
    """Refuse train.run_dir naming an object store: it would be created as a local
    directory named after the scheme ('s3:'), silently."""
    value = train.run_dir
    if value and is_store_url(value):
        raise ConfigError("train.run_dir", value, LOCAL_ONLY, LOCAL_ONLY_WHY)


def check_checkpoint_store(checkpoint: CheckpointConfig) -> None:
    """With checkpoint.dir a store URL: write and delete one probe object under it, both
    within checkpoint.store_timeout_s, so a missing bucket, credentials that may not write
    or a store that does not answer stop the launch now, not at the first save; ConfigError
    naming checkpoint.dir and carrying the store's own error."""
    url = checkpoint.dir
    if not (url and is_store_url(url)):
        return
    probe_url = join(url, f".write-probe-{uuid.uuid4().hex}")
    deadline = Deadline(checkpoint.store_timeout_s, TIMEOUT_FIELD)
    try:
        write_bytes(probe_url, b"", deadline=deadline)
        remove(probe_url, deadline=deadline)
    except StoreError as exc:
        raise ConfigError(
            "checkpoint.dir", url, "a store location this job may write and delete in", str(exc)
        ) from None


def store_save_limits(checkpoint: CheckpointConfig) -> dict[str, float]:
    """The hang watchdog's floor for a checkpoint when checkpoint.dir is a store: the
    store's own deadlines of one save (store_saves.DEADLINES_PER_SAVE times
    checkpoint.store_timeout_s) beyond the watchdog's least limit, so a stalled store fails
    the save (a checkpoint_failed event) instead of ending the run as a hang; none else."""
    if not is_store_url(checkpoint.dir):  # an empty dir is the run's local default
        return {}
    store_s = DEADLINES_PER_SAVE * checkpoint.store_timeout_s
    return {CHECKPOINT: FLOOR_S + store_s}


def check_stores(config: JobConfig) -> None:
    """Ask each store the job reads for the listing of its path, once per path, with the
    stores' bounded timeouts; the first that fails is a ConfigError naming its field and
    carrying the store's own error."""
    check_local_dirs(config.train)
    check_checkpoint_store(config.checkpoint)
    for field, url in data_urls(config.data, config.eval):
        try:
            probe(url)
        except StoreError as exc:
            raise ConfigError(
                field, url, "a prepare-data directory the store lets this job read", str(exc)
            ) from None
