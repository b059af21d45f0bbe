"""The registered architectures by model_type, and the two ways one is chosen: by a folder's
model_type (import) and by what our ModelConfig needs (export)."""

from __future__ import annotations

from collections.abc import KeysView

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError, closest_name
from kempnerforge.interop.architectures.architecture import Architecture
from kempnerforge.interop.architectures.config_keys import HFConfig


class Architectures:
    """The architectures kempnerforge converts exactly, in export's order of preference.

    Not config/registry.py's Registry: no config value names an architecture. Import takes
    the one a folder's config.json names, so an unknown model_type is an HFFolderError
    naming the file; export takes the first, in registration order, that represents the
    model exactly.
    """

    def __init__(self, *architectures: Architecture) -> None:
        self._by_type: dict[str, Architecture] = {}
        for architecture in architectures:
            self.register(architecture)

    @property
    def model_types(self) -> KeysView[str]:
        """The registered model_types in registration order (a live view)."""
        return self._by_type.keys()

    def register(self, architecture: Architecture) -> None:
        """Add ``architecture`` after those registered; a ValueError if its model_type is taken."""
        if architecture.model_type in self._by_type:
            known = self._by_type[architecture.model_type]
            raise ValueError(
                f"model_type {architecture.model_type!r} ({architecture.hf_class}) is already "
                f"registered, by {known.hf_class}"
            )
        self._by_type[architecture.model_type] = architecture

    def unregister(self, architecture: Architecture) -> None:
        """Remove what ``register`` added (a test's own architecture, after the test)."""
        if self._by_type.get(architecture.model_type) is architecture:
            del self._by_type[architecture.model_type]

    def named(self, model_type: str) -> Architecture:
        """The architecture registered as ``model_type``; a ConfigError lists them."""
        if model_type not in self._by_type:
            suggestion = closest_name(model_type, self._by_type)
            raise ConfigError(
                "model_type",
                model_type,
                "one of " + ", ".join(self.model_types),
                f"did you mean {suggestion!r}?" if suggestion else "",
            )
        return self._by_type[model_type]

    def of_folder(self, hf: HFConfig) -> Architecture:
        """The architecture a folder's config.json names; an HFFolderError naming the file
        and the registered model_types when there is none."""
        model_type = hf.data.get("model_type")
        if not isinstance(model_type, str) or model_type not in self._by_type:
            raise hf.error(
                "model_type",
                f"expected one of {', '.join(self.model_types)} (the architectures "
                "kempnerforge computes exactly)",
            )
        return self._by_type[model_type]

    def for_config(self, cfg: ModelConfig) -> Architecture:
        """The first registered architecture that represents ``cfg`` exactly. When none
        does, the ConfigError of the closest (the one meeting the most of its requirements
        before the first unmet, the earliest registered on a tie) names the field."""
        closest: tuple[int, ConfigError] | None = None
        for architecture in self._by_type.values():
            met, refusal = architecture.matched(cfg)
            if refusal is None:
                return architecture
            if closest is None or met > closest[0]:
                closest = (met, refusal)
        if closest is None:
            raise ConfigError("model_type", None, "a registered architecture", "none is registered")
        raise closest[1]
