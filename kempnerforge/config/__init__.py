"""Typed run configuration: one dataclass per TOML section, loaded and checked at startup.

Importing this package stays light (no torch), so tools can read and check a config fast.
"""

from kempnerforge.config.job import JobConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError

__all__ = ["ConfigError", "JobConfig", "load_config"]
