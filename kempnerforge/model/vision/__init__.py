"""Vision-language models: the vision encoder, the adapter, gated cross-attention and the model
that joins them to the decoder.

Modules outside this folder import these names from here, never from its modules.
"""

from __future__ import annotations

from kempnerforge.model.vision.vlm import VisionLanguageModel, build_vlm

__all__ = ["VisionLanguageModel", "build_vlm"]
