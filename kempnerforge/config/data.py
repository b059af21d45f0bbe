"""[data]: where training tokens come from and how they are loaded."""

from __future__ import annotations

from dataclasses import dataclass

from kempnerforge.config.checks import check_at_least, check_in_range
from kempnerforge.config.errors import ConfigError


@dataclass
class DataConfig:
    path: str = ""
    """Directory written by `kempnerforge prepare-data`; empty uses the built-in corpus."""
    eval_path: str = ""
    """Held-out directory from prepare-data; empty uses the built-in corpus's held-out split."""
    tokenizer: str = "byte"
    """'byte' (built-in byte-level tokenizer) or a path to a Hugging Face tokenizer.json."""
    cache_dir: str = ""
    """Where the built-in corpus is prepared; empty means $KEMPNERFORGE_CACHE or
    ~/.cache/kempnerforge."""
    builtin_eval_fraction: float = 0.02
    """Fraction of the built-in corpus's documents held out for eval."""
    num_workers: int = 0
    """Dataloader worker processes; 0 loads in the training process."""
    shuffle: bool = True
    """Shuffle training windows each epoch (seeded by train.seed and the epoch)."""
    document_masking: bool = True
    """Keep attention and the loss inside each packed document (no attending or predicting
    across an end-of-document token)."""

    def __post_init__(self) -> None:
        check_at_least("data.num_workers", self.num_workers, 0)
        check_in_range("data.builtin_eval_fraction", self.builtin_eval_fraction, 0.0, 0.5)
        if not self.tokenizer:
            raise ConfigError("data.tokenizer", self.tokenizer, "'byte' or a tokenizer.json path")
