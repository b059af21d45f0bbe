"""nn.Modules of the decoder-only Transformer, its builder, and decoding (greedy samples,
and sampled generation with a key/value cache)."""

from kempnerforge.model.generation import KVCache, forward_cached, generate, generate_greedy
from kempnerforge.model.transformer import Transformer, build_model

__all__ = ["KVCache", "Transformer", "build_model", "forward_cached", "generate", "generate_greedy"]
