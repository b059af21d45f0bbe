"""load_config: TOML file + `--section.field=value` overrides -> a validated-per-section JobConfig.

Layers, each applied by rebuilding the dataclasses so every __post_init__ sees merged values:
dataclass defaults, then files named by a top-level ``include = [...]`` (paths relative to the
including file, e.g. a model preset), then the file itself, then CLI overrides.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
import types
import typing
from collections.abc import Sequence
from typing import Any

import tomli_w

from kempnerforge.config.job import JobConfig
from kempnerforge.core.errors import ConfigError, unknown_key_error

_MAX_INCLUDE_DEPTH = 8
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def load_config(path: str | None, overrides: Sequence[str] = ()) -> JobConfig:
    """Build a JobConfig from a TOML file (None: defaults only) and CLI overrides."""
    merged: dict[str, Any] = {} if path is None else _read_toml_with_includes(path, depth=0)
    for override in overrides:
        dotted, value = parse_override(override)
        _set_dotted(merged, dotted, value)
    return build_dataclass(JobConfig, merged, prefix="")


def parse_override(text: str) -> tuple[str, Any]:
    """'--train.max_steps=20' -> ('train.max_steps', 20).

    The value is read as a TOML value (numbers, booleans, strings in quotes, [lists]);
    anything that is not valid TOML is taken as a bare string, so --train.name=run1 works.
    A flag without '=' means true.
    """
    if not text.startswith("--"):
        raise ConfigError("<override>", text, "an override of the form --section.field=value")
    body = text[2:]
    dotted, has_value, raw = body.partition("=")
    if not dotted or "." not in dotted or any(not part for part in dotted.split(".")):
        raise ConfigError("<override>", text, "an override of the form --section.field=value")
    if not has_value:
        return dotted, True
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except ValueError:  # not TOML (TOMLDecodeError), or an integer of over 4300 digits
        value = raw
    return dotted, _RawText(raw, value)


class _RawText:
    """A CLI value plus the text it came from, so a str field can take '--train.name=123'."""

    def __init__(self, raw: str, value: Any) -> None:
        self.raw = raw
        self.value = value


def _read_toml_with_includes(
    path: str, depth: int, field: str = "<config file>", hint: str = ""
) -> dict[str, Any]:
    """Read one TOML file and, first, the files its ``include`` names.

    ``field`` and ``hint`` say where the path came from in error messages: "<config file>"
    for the file named on the command line, "include" (with the including file) otherwise.
    """
    if depth > _MAX_INCLUDE_DEPTH:
        raise ConfigError("include", path, f"at most {_MAX_INCLUDE_DEPTH} levels of include")
    data = _read_toml(path, field, hint)
    includes = data.pop("include", [])
    if isinstance(includes, str):
        includes = [includes]
    if not isinstance(includes, list) or not all(isinstance(i, str) for i in includes):
        raise ConfigError("include", includes, "a list of TOML file paths", f"in {path}")
    merged: dict[str, Any] = {}
    base = os.path.dirname(os.path.abspath(path))
    for included in includes:
        child = _read_toml_with_includes(
            os.path.join(base, included), depth + 1, "include", f"included by {path}"
        )
        _deep_merge(merged, child)
    _deep_merge(merged, data)
    return merged


def _read_toml(path: str, field: str, hint: str) -> dict[str, Any]:
    """Parse one TOML file; every way it can fail to be one is a ConfigError naming it."""

    def error(allowed: str, detail: str = "") -> ConfigError:
        return ConfigError(field, path, allowed, "; ".join(t for t in (detail, hint) if t))

    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except (FileNotFoundError, NotADirectoryError):
        raise error("an existing TOML file") from None
    except IsADirectoryError:
        raise error("a TOML file", "it is a directory") from None
    except UnicodeDecodeError as e:
        detail = f"byte 0x{e.object[e.start]:02x} at offset {e.start} is not UTF-8"
        raise error("a UTF-8 TOML file", detail) from None
    except tomllib.TOMLDecodeError as e:
        raise error("valid TOML", str(e)) from None
    except ValueError as e:  # an integer literal longer than Python converts (4300 digits)
        raise error("valid TOML", str(e).split(";")[0]) from None
    except OSError as e:
        raise error("a readable TOML file", e.strerror or type(e).__name__) from None


def _deep_merge(into: dict[str, Any], other: dict[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            field = ".".join(parents[: i + 1])
            raise ConfigError(field, child, "a section (table)", f"cannot set {dotted}")
        node = child
    node[leaf] = value


def build_dataclass(cls: type, values: Any, prefix: str) -> Any:
    """Construct dataclass ``cls`` from a dict, coercing each field to its declared type."""
    if isinstance(values, _RawText):
        values = values.value
    if not isinstance(values, dict):
        raise ConfigError(prefix or "<root>", values, "a table of fields")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            raise unknown_key_error(dotted, fields)
        kwargs[key] = coerce(hints[key], value, dotted)
    try:
        return cls(**kwargs)
    except TypeError as e:  # a __post_init__ comparing incompatible types
        field = prefix.rstrip(".") or "<root>"
        raise ConfigError(field, values, "valid field types", str(e)) from None


def coerce(hint: Any, value: Any, field: str) -> Any:
    """Convert a TOML/CLI value to the declared type ``hint`` or raise ConfigError."""
    raw = value.raw if isinstance(value, _RawText) else None
    if isinstance(value, _RawText):
        value = value.value
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        is_none = value is None or (raw is not None and raw.lower() in ("none", "null"))
        if is_none and type(None) in options:
            return None
        tables = [o for o in options if dataclasses.is_dataclass(o) and isinstance(o, type)]
        if isinstance(value, dict) and len(tables) == 1:
            # An optional section given as a table: its own errors name its own fields.
            return coerce(tables[0], value, field)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return coerce(option, _RawText(raw, value) if raw is not None else value, field)
            except ConfigError as e:
                errors.append(e.allowed)
        raise ConfigError(field, value, " or ".join(errors + ["none"]))
    if origin is list:
        (item_hint,) = typing.get_args(hint) or (Any,)
        if not isinstance(value, list):
            raise ConfigError(field, value, f"a list of {_type_name(item_hint)}")
        return [coerce(item_hint, item, f"{field}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        key_hint, value_hint = typing.get_args(hint) or (str, Any)
        if not isinstance(value, dict):
            raise ConfigError(field, value, f"a table of {_type_name(value_hint)}")
        return {
            coerce(key_hint, k, f"{field}.{k}"): coerce(value_hint, v, f"{field}.{k}")
            for k, v in value.items()
        }
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return build_dataclass(hint, value, prefix=f"{field}.")
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(field, value, "true or false")
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(field, value, "an integer")
        # TOML integers are unbounded in Python; every int field ends up in a C int64
        # somewhere (a tensor, a seed), so larger ones are refused here whatever the field.
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise ConfigError(field, value, "an integer in [-2**63, 2**63 - 1]")
        return value
    if hint is float:
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ConfigError(field, value, "a number")
        try:
            number = float(value)
        except OverflowError:  # an int beyond the float range
            number = math.inf
        if not math.isfinite(number):
            raise ConfigError(field, value, "a finite number")
        return number
    if hint is str:
        if isinstance(value, str):
            return value
        if raw is not None:
            return raw
        raise ConfigError(field, value, "a string")
    if hint is Any:
        return value
    raise TypeError(f"{field}: unsupported config field type {hint!r}")


def _type_name(hint: Any) -> str:
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def config_to_dict(config: Any) -> dict[str, Any]:
    """A dataclass config as plain TOML-writable data (None fields left out)."""
    return _drop_none(dataclasses.asdict(config))


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value


def dump_config(config: JobConfig) -> str:
    """The resolved config as TOML text; load_config on it gives back an equal JobConfig."""
    return tomli_w.dumps(config_to_dict(config))


def save_config(config: JobConfig, path: str) -> None:
    """Write the resolved config atomically (a reader never sees half a file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(dump_config(config))
    os.replace(tmp, path)
