"""[data]: where training tokens come from and how they are loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kempnerforge.config.checks import (
    check_at_least,
    check_in_range,
    check_named_paths,
    check_positive,
)
from kempnerforge.core.errors import ConfigError

MAX_NUM_WORKERS = 256
"""Most dataloader worker processes per rank: each is a forked copy of the training process,
and loading memory-mapped windows keeps a few busy; far more only exhausts memory and pids."""

MAX_STORE_READ_AHEAD_MB = 1024
"""Largest read-ahead per token file in a store: each loader worker holds one buffer per
open file (up to 8), so more would cost gigabytes of memory per worker."""
MIN_STORE_CACHE_GB = 0.01
"""Smallest store cache: a few of its 4 MiB blocks."""
MAX_STORE_CACHE_GB = float(2**20)
"""Largest store cache, a PiB: far beyond any local disk, a bound only against typos."""


@dataclass
class DatasetSourceConfig:
    """One `[[data.datasets]]` table: a named source of a training mixture."""

    name: str = ""
    """Name of the source in metrics and phase weights; letters, digits, '_' and '-'."""
    path: str = ""
    """Directory written by `kempnerforge prepare-data` with the job's tokenizer, or its URL
    in an object store (s3://bucket/corpus, gs://..., any fsspec protocol)."""
    weight: float = 1.0
    """Relative sampling weight (>= 0; 0 never draws this source). Only ratios matter."""


@dataclass
class DataConfig:
    path: str = ""
    """Directory written by `kempnerforge prepare-data`, or its URL in an object store
    (s3://bucket/corpus, gs://..., any fsspec protocol; see docs/data.md); empty uses the
    built-in corpus."""
    eval_path: str = ""
    """Held-out directory from prepare-data (`--eval-output`), or its URL in an object store.
    Empty: the built-in corpus's held-out split when data.path and data.datasets are empty,
    otherwise no eval data (a job with eval.interval > 0 then warns at start-up, and
    `kempnerforge eval` refuses)."""
    tokenizer: str = "byte"
    """'byte' (built-in byte-level tokenizer) or a path to a Hugging Face tokenizer.json."""
    cache_dir: str = ""
    """Where the built-in corpus is prepared, and the store cache kept (data.store_cache_gb);
    empty means $KEMPNERFORGE_CACHE or ~/.cache/kempnerforge."""
    builtin_eval_fraction: float = 0.02
    """Fraction of the built-in corpus's documents held out for eval."""
    builtin_bos: bool = False
    """Start each built-in corpus document with the tokenizer's BOS token (prepared data gets
    this from `prepare-data --bos`); needs a tokenizer whose BOS is not its EOS."""
    num_workers: int = 0
    """Dataloader worker processes, 0 to 256; 0 loads in the training process. Workers ignore
    stop signals: the training process saves and stops them."""
    shuffle: bool = True
    """Shuffle training windows each epoch (seeded by train.seed and the epoch)."""
    document_masking: bool = True
    """Keep attention and the loss inside each packed document (no attending or predicting
    across an end-of-document token). A loss-masked corpus marks its document ends in
    token_flags.bin instead of by EOS, and never predicts across them either way."""
    datasets: list[DatasetSourceConfig] = field(default_factory=list)
    """Training mixture (`[[data.datasets]]` tables with name, path and weight); empty means
    the single dataset data.path. Give one or the other, not both."""
    mix_temperature: float = 1.0
    """Mixture temperature T > 0: source i is drawn with probability proportional to
    weight_i ** (1 / T); T > 1 flattens the mixture, T < 1 sharpens it, 1 keeps the weights."""

    store_read_ahead_mb: int = 8
    """MiB fetched in one request when reads move forward through a token file in an object
    store (evaluation, data.shuffle = false): a store answers in tens of milliseconds, so
    bigger requests pay that latency once per many windows. Shuffled training windows are
    each fetched exactly, in one ranged request. 0 to 1024; 0 fetches every window exactly."""
    store_cache_gb: float = 0.0
    """GiB of local disk caching blocks of token files read from an object store, under
    data.cache_dir (or its default) in store/, shared by the host's ranks and workers; later
    epochs then read from disk. 0 caches nothing; otherwise 0.01 to 2**20. The least
    recently used blocks are deleted past the limit."""

    def __post_init__(self) -> None:
        check_at_least("data.num_workers", self.num_workers, 0, MAX_NUM_WORKERS)
        check_at_least(
            "data.store_read_ahead_mb", self.store_read_ahead_mb, 0, MAX_STORE_READ_AHEAD_MB
        )
        check_at_least("data.store_cache_gb", self.store_cache_gb, 0.0, MAX_STORE_CACHE_GB)
        if 0 < self.store_cache_gb < MIN_STORE_CACHE_GB:
            raise ConfigError(
                "data.store_cache_gb",
                self.store_cache_gb,
                f"0 (no cache) or at least {MIN_STORE_CACHE_GB}",
                "the cache keeps whole blocks of 4 MiB",
            )
        check_in_range("data.builtin_eval_fraction", self.builtin_eval_fraction, 0.0, 0.5)
        if not self.tokenizer:
            raise ConfigError("data.tokenizer", self.tokenizer, "'byte' or a tokenizer.json path")
        check_positive("data.mix_temperature", self.mix_temperature)
        self._check_datasets()

    def _check_datasets(self) -> None:
        if not self.datasets:
            return
        if self.path:
            raise ConfigError(
                "data.path",
                self.path,
                "an empty path when data.datasets is given",
                "give data.path or [[data.datasets]], not both",
            )
        check_named_paths("data.datasets", self.datasets, "dataset")
        for i, source in enumerate(self.datasets):
            where = f"data.datasets[{i}]"
            if not (isinstance(source.weight, int | float) and math.isfinite(source.weight)):
                raise ConfigError(f"{where}.weight", source.weight, "a number >= 0")
            if source.weight < 0:
                raise ConfigError(f"{where}.weight", source.weight, "a number >= 0")
        if all(source.weight == 0 for source in self.datasets):
            raise ConfigError(
                "data.datasets[0].weight",
                self.datasets[0].weight,
                "a weight > 0 on at least one dataset",
                "all weights are 0",
            )

    @property
    def is_mixture(self) -> bool:
        """True when training reads a [[data.datasets]] mixture."""
        return bool(self.datasets)
