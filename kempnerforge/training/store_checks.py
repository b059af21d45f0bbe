"""Start-up checks of the paths a job names in object stores: the stores it reads are asked
once, so a missing bucket, refused credentials or an unreachable endpoint stop the launch
before anything is built; and a URL where only local paths work yet is refused."""

from __future__ import annotations

from kempnerforge.config.job import JobConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.storage.files import probe
from kempnerforge.storage.location import is_store_url
from kempnerforge.storage.stores import StoreError

LOCAL_ONLY = "a local or mounted directory"
LOCAL_ONLY_WHY = (
    "object-store checkpoints and run directories are not supported yet; use a local path or "
    "a store mounted as a directory, and name object stores only in data paths"
)


def data_urls(config: JobConfig) -> list[tuple[str, str]]:
    """(config field, URL) of every data path the job reads from an object store."""
    data = config.data
    named = [("data.path", data.path), ("data.eval_path", data.eval_path)]
    named += [(f"data.datasets[{i}].path", s.path) for i, s in enumerate(data.datasets)]
    named += [(f"eval.sets[{i}].path", s.path) for i, s in enumerate(config.eval.sets)]
    return [(field, path) for field, path in named if path and is_store_url(path)]


def check_local_dirs(config: JobConfig) -> None:
    """Refuse checkpoint.dir or train.run_dir naming an object store: they would be created
    as a local directory named after the scheme ('s3:'), silently."""
    for field, value in (
        ("train.run_dir", config.train.run_dir),
        ("checkpoint.dir", config.checkpoint.dir),
    ):
        if value and is_store_url(value):
            raise ConfigError(field, value, LOCAL_ONLY, LOCAL_ONLY_WHY)


def check_stores(config: JobConfig) -> None:
    """Ask each store the job reads for the listing of its path, once per path, with the
    stores' bounded timeouts; the first that fails is a ConfigError naming its field and
    carrying the store's own error."""
    check_local_dirs(config)
    for field, url in data_urls(config):
        try:
            probe(url)
        except StoreError as exc:
            raise ConfigError(
                field, url, "a prepare-data directory the store lets this job read", str(exc)
            ) from None
