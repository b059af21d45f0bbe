"""The registered model families and the one choice between them, family_of.

A job is the family whose config section it sets ([vlm] for the vision-language model);
a job that sets none is a text model. A new family registers here, in one line."""

from __future__ import annotations

from kempnerforge.config.job import JobConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.training.families.family import ModelFamily
from kempnerforge.training.families.text import TEXT
from kempnerforge.training.families.vision_language import VISION_LANGUAGE

DEFAULT_FAMILY = TEXT
"""The family of a job that sets no family's section."""

_SECTIONED: list[ModelFamily] = [VISION_LANGUAGE]
"""The families a config section selects, in registration order."""


def register_family(family: ModelFamily) -> None:
    """Add ``family``: from now on a job that sets its section is of that family.

    A family needs a section of its own (a JobConfig field) and a name no other family
    has; a ValueError says which is missing or taken."""
    if family.section is None:
        raise ValueError(f"family {family.name!r} names no config section that selects it")
    for known in (DEFAULT_FAMILY, *_SECTIONED):
        if known.name == family.name or known.section == family.section:
            raise ValueError(
                f"family {family.name!r} (section {family.section!r}) clashes with the "
                f"registered family {known.name!r} (section {known.section!r})"
            )
    _SECTIONED.append(family)


def unregister_family(family: ModelFamily) -> None:
    """Remove a family register_family added (a test's own family, after the test)."""
    _SECTIONED.remove(family)


def family_of(config: JobConfig) -> ModelFamily:
    """The model family of this job: the one whose section the config sets, else text;
    a ConfigError when it sets the sections of two families."""
    chosen = [f for f in _SECTIONED if getattr(config, str(f.section), None) is not None]
    if len(chosen) > 1:
        first, second = chosen[0], chosen[1]
        raise ConfigError(
            str(second.section),
            "a table",
            f"no [{second.section}] table beside [{first.section}]",
            f"a job trains one kind of model: {first.name} or {second.name}",
        )
    return chosen[0] if chosen else DEFAULT_FAMILY
