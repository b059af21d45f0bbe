"""The model families: what differs between a text model and a vision-language model (the
build, the data, the step body, the eval forward, the sample, the size, the freeze
groups), one ModelFamily value each, and family_of, the one choice between them.

- family.py: the ModelFamily shape, and what the families share.
- text.py, vision_language.py: the two families.
- registry.py: the registered families; family_of picks the one whose config section the
  job sets. A new family is a file like text.py plus its line in registry.py.

The model each family builds keeps the FamilyModel contract of model/contract.py, the
only thing distributed/ and the build know of it.
"""

from kempnerforge.model.contract import FamilyModel
from kempnerforge.training.families.family import (
    COMMANDS,
    ModelFamily,
    ModelSummary,
    SampleFn,
    StepFn,
    sliced_for_context_parallel,
)
from kempnerforge.training.families.registry import (
    DEFAULT_FAMILY,
    family_of,
    register_family,
    unregister_family,
)
from kempnerforge.training.families.text import TEXT, prompt_ids
from kempnerforge.training.families.vision_language import VISION_LANGUAGE

__all__ = [
    "COMMANDS",
    "DEFAULT_FAMILY",
    "TEXT",
    "VISION_LANGUAGE",
    "FamilyModel",
    "ModelFamily",
    "ModelSummary",
    "SampleFn",
    "StepFn",
    "family_of",
    "prompt_ids",
    "register_family",
    "sliced_for_context_parallel",
    "unregister_family",
]
