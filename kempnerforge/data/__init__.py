"""Data: tokenizers, prepare-data, memory-mapped windows, the sharded sampler and the pipeline.

The names below load on first use, so importing the package does not import torch or numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kempnerforge.core.errors import DataError
    from kempnerforge.data.builtin import builtin_corpus, default_cache_dir, stdlib_dir
    from kempnerforge.data.dataloader import TrainDataLoader
    from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
    from kempnerforge.data.pipeline import DataPipeline
    from kempnerforge.data.pipeline_build import build_data_pipeline
    from kempnerforge.data.prepare import prepare_data
    from kempnerforge.data.sampling import ShardedSampler
    from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer
    from kempnerforge.data.tokens import read_meta

_HOMES = {
    "IGNORE_INDEX": "kempnerforge.data.dataset",
    "ByteTokenizer": "kempnerforge.data.tokenizer",
    "DataError": "kempnerforge.core.errors",
    "DataPipeline": "kempnerforge.data.pipeline",
    "HFTokenizer": "kempnerforge.data.tokenizer",
    "MemoryMappedDataset": "kempnerforge.data.dataset",
    "ShardedSampler": "kempnerforge.data.sampling",
    "Tokenizer": "kempnerforge.data.tokenizer",
    "TrainDataLoader": "kempnerforge.data.dataloader",
    "build_data_pipeline": "kempnerforge.data.pipeline_build",
    "builtin_corpus": "kempnerforge.data.builtin",
    "default_cache_dir": "kempnerforge.data.builtin",
    "load_tokenizer": "kempnerforge.data.tokenizer",
    "prepare_data": "kempnerforge.data.prepare",
    "read_meta": "kempnerforge.data.tokens",
    "stdlib_dir": "kempnerforge.data.builtin",
}

__all__ = [
    "ByteTokenizer",
    "DataError",
    "DataPipeline",
    "HFTokenizer",
    "IGNORE_INDEX",
    "MemoryMappedDataset",
    "ShardedSampler",
    "Tokenizer",
    "TrainDataLoader",
    "build_data_pipeline",
    "builtin_corpus",
    "default_cache_dir",
    "load_tokenizer",
    "prepare_data",
    "read_meta",
    "stdlib_dir",
]


def __getattr__(name: str) -> Any:
    """Import the module that defines `name` the first time someone asks for it."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
