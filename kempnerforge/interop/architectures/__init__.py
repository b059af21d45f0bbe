"""The Hugging Face architectures kempnerforge converts exactly, one module and one
Architecture record each, and ARCHITECTURES, the registry export and import ask.

- architecture.py: the Architecture record (model_type, class name, requirements on our
  ModelConfig, config.json both ways, tensors both ways) and its Requirement.
- registry.py: Architectures, the registry: by a folder's model_type for import, the first
  that represents a ModelConfig exactly for export.
- llama.py, mistral.py, qwen3.py, olmo2.py, gemma3.py, mixtral.py, qwen2_moe.py,
  qwen3_moe.py, glm4_moe.py, gpt_oss.py, deepseek_v3.py: one architecture each.
- config_keys.py, tensor_names.py, moe_parts.py, mtp_layers.py: what several
  architectures share (the common config.json keys and HFConfig's checked reads; Llama's
  tensor names and HFTensors; the expert layout and the reads of the MoE classes; the
  multi-token-prediction layers DeepSeek-V3 and GLM-4-MoE store after the decoder's).

The shared config keys and tensor names live here, beside the architectures, because only
an architecture reads them: they are the parts of a dialect that several dialects have in
common. What concerns a folder or our model whatever the dialect stays in interop/:
reading and writing the folder's files (hf_files.py), gathering a model's state and
copying one back (hf_state.py), the checks that a model, its config and a folder describe
one function (hf_model_checks.py), and the entry points (hf.py).

A new architecture is a module here defining its Architecture (sharing what it can from
the three shared modules) and its entry in ARCHITECTURES below; nothing else changes.
Modules outside this wing import the names below, never its modules.
"""

from kempnerforge.interop.architectures.architecture import (
    Architecture,
    Requirement,
    Shapes,
    State,
)
from kempnerforge.interop.architectures.config_keys import (
    HFConfig,
    common_config_json,
    common_model_fields,
)
from kempnerforge.interop.architectures.deepseek_v3 import DEEPSEEK_V3
from kempnerforge.interop.architectures.gemma3 import GEMMA3
from kempnerforge.interop.architectures.glm4_moe import GLM4_MOE
from kempnerforge.interop.architectures.gpt_oss import GPT_OSS
from kempnerforge.interop.architectures.llama import LLAMA
from kempnerforge.interop.architectures.mistral import MISTRAL
from kempnerforge.interop.architectures.mixtral import MIXTRAL
from kempnerforge.interop.architectures.mtp_layers import held_mtp_depth
from kempnerforge.interop.architectures.olmo2 import OLMO2
from kempnerforge.interop.architectures.qwen2_moe import QWEN2_MOE
from kempnerforge.interop.architectures.qwen3 import QWEN3
from kempnerforge.interop.architectures.qwen3_moe import QWEN3_MOE
from kempnerforge.interop.architectures.registry import Architectures
from kempnerforge.interop.architectures.tensor_names import HFTensors, shared_pairs

ARCHITECTURES = Architectures(
    LLAMA,
    MISTRAL,
    QWEN3,
    OLMO2,
    GEMMA3,
    MIXTRAL,
    QWEN2_MOE,
    QWEN3_MOE,
    GLM4_MOE,
    GPT_OSS,
    DEEPSEEK_V3,
)
"""Every architecture export and import know, in export's order of preference: a model two
of them represent is written as the earlier (a softmax top-2 MoE as Mixtral, a dense model
without a window as Llama)."""

__all__ = [
    "ARCHITECTURES",
    "DEEPSEEK_V3",
    "GEMMA3",
    "GLM4_MOE",
    "GPT_OSS",
    "LLAMA",
    "MISTRAL",
    "MIXTRAL",
    "OLMO2",
    "QWEN2_MOE",
    "QWEN3",
    "QWEN3_MOE",
    "Architecture",
    "Architectures",
    "HFConfig",
    "HFTensors",
    "Requirement",
    "Shapes",
    "State",
    "common_config_json",
    "common_model_fields",
    "held_mtp_depth",
    "shared_pairs",
]
