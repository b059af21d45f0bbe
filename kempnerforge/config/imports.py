"""The objects a config names as 'package.module:attribute' (train.hooks, grpo.reward),
imported the way ``python -m`` finds modules, each failure a ConfigError naming the field,
what went wrong and what to do."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from kempnerforge.core.errors import ConfigError, closest_name


def import_named(field: str, spec: str, allowed: str) -> Any:
    """The object ``spec`` ('package.module:name', the name maybe dotted: 'mod:Class.fn')
    names. The working directory goes first on sys.path, as ``python -m`` has it, so a file
    next to where the run is launched imports with the installed command too.

    Raises ConfigError(field, spec, allowed, hint): no single ':', a module that does not
    import (its error; where to put it when it is the module itself that is missing), an
    attribute that is not there (with the closest name there is).
    """
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise ConfigError(field, spec, allowed, "expected exactly one ':'")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        hint = f"cannot import {module_name!r}: {type(e).__name__}: {e}"
        missing = e.name if isinstance(e, ModuleNotFoundError) else None
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            hint += f"; is its directory the working directory ({cwd}) or on PYTHONPATH?"
        raise ConfigError(field, spec, allowed, hint) from e
    found: Any = module
    owner = module_name
    for attr in attr_path.split("."):
        if not hasattr(found, attr):
            hint = f"no attribute {attr!r} in {owner!r}"
            suggestion = closest_name(attr, [n for n in dir(found) if not n.startswith("_")])
            if suggestion:
                hint += f"; did you mean {suggestion!r}?"
            raise ConfigError(field, spec, allowed, hint)
        found = getattr(found, attr)
        owner = f"{owner}.{attr}"
    return found
