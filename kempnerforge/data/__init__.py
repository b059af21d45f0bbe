"""Data: tokenizers, prepare-data, memory-mapped windows, the sharded sampler and the pipeline."""

from kempnerforge.data.builtin import builtin_corpus, default_cache_dir, stdlib_dir
from kempnerforge.data.dataset import IGNORE_INDEX, MemoryMappedDataset
from kempnerforge.data.errors import DataError
from kempnerforge.data.loader import TrainDataLoader
from kempnerforge.data.pipeline import DataPipeline, build_data_pipeline
from kempnerforge.data.prepare import add_prepare_data_arguments, prepare_data, run_prepare_data
from kempnerforge.data.sampler import ShardedSampler
from kempnerforge.data.token_file import read_meta
from kempnerforge.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "ByteTokenizer",
    "DataError",
    "DataPipeline",
    "HFTokenizer",
    "MemoryMappedDataset",
    "ShardedSampler",
    "Tokenizer",
    "TrainDataLoader",
    "add_prepare_data_arguments",
    "build_data_pipeline",
    "builtin_corpus",
    "default_cache_dir",
    "load_tokenizer",
    "prepare_data",
    "read_meta",
    "run_prepare_data",
    "stdlib_dir",
]
