"""nn.Modules of the decoder-only Transformer, its builder and greedy decoding."""

from kempnerforge.model.generate import generate_greedy
from kempnerforge.model.transformer import Transformer, build_model

__all__ = ["Transformer", "build_model", "generate_greedy"]
