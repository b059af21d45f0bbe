"""Decoding: greedy samples during training and sampled generation with a key/value cache.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.model.generation.generate import (
    eval_mode,
    generate,
    generate_greedy,
    sample_token,
    seeded_generator,
)
from kempnerforge.model.generation.kv_cache import KVCache, forward_cached

__all__ = [
    "KVCache",
    "eval_mode",
    "forward_cached",
    "generate",
    "generate_greedy",
    "sample_token",
    "seeded_generator",
]
