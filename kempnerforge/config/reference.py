"""The config reference (docs/config.md), generated from the sections' attribute docstrings.

Regenerate with `python -m kempnerforge.config.reference > docs/config.md`; a test fails
when the committed page and the code disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import typing

from kempnerforge.config.job import JobConfig


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass: the string literal right after each field."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f'"{value}"'
    return repr(value)


def _type_name(cls: type, name: str) -> str:
    return str(cls.__annotations__[name]).replace("'", "").replace(" | ", " or ")


def config_reference_markdown() -> str:
    lines = [
        "# Config reference",
        "",
        "Every field of every section, with its default. Generated from the code by",
        "`python -m kempnerforge.config.reference`; do not edit by hand.",
        "",
        "Set fields in a TOML file (`[train]` then `max_steps = 100`) or on the command line",
        '(`--train.max_steps=100`). A top-level `include = ["../model/debug.toml"]` merges',
        "other files first (paths relative to the including file).",
    ]
    hints = typing.get_type_hints(JobConfig)
    for section in dataclasses.fields(JobConfig):
        cls = section_class(hints[section.name])
        docs = field_docs(cls)
        lines += ["", f"## [{section.name}]", ""]
        if section.default is None:
            lines += [_OPTIONAL_SECTIONS.get(section.name, "Optional section."), ""]
        lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            meaning = docs.get(f.name, "").replace("|", "\\|")
            lines.append(
                f"| `{f.name}` | `{_type_name(cls, f.name)}` | `{_default(f)}` | {meaning} |"
            )
        lines += _nested_tables(cls)
    return "\n".join(lines) + "\n"


_OPTIONAL_SECTIONS = {
    "vision_encoder": "Optional; required by `[vlm]` (see docs/vlm.md).",
    "adapter": "Optional; takes these defaults when a `[vlm]` job omits it.",
    "vlm": "Optional; its presence makes the job a vision-language model (docs/vlm.md).",
}


def section_classes() -> dict[str, type]:
    """Each JobConfig section's name and dataclass, in order (optional sections too)."""
    hints = typing.get_type_hints(JobConfig)
    return {f.name: section_class(hints[f.name]) for f in dataclasses.fields(JobConfig)}


def section_class(hint: object) -> type:
    """The dataclass of a JobConfig section, also of an optional one (X | None)."""
    options = [hint, *typing.get_args(hint)]
    for option in options:
        if isinstance(option, type) and dataclasses.is_dataclass(option):
            return option
    raise TypeError(f"{hint} is not a config section class")


def _nested_tables(cls: type) -> list[str]:
    """Tables of the dataclasses a section's list fields hold (freeze specs, stages)."""
    lines: list[str] = []
    hints = typing.get_type_hints(cls)
    seen: set[type] = set()
    pending = [hints[f.name] for f in dataclasses.fields(cls)]
    while pending:
        hint = pending.pop(0)
        for arg in typing.get_args(hint):
            if not (isinstance(arg, type) and dataclasses.is_dataclass(arg)) or arg in seen:
                continue
            seen.add(arg)
            docs = field_docs(arg)
            lines += ["", f"`{arg.__name__}` (an entry of a list above):", ""]
            lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
            for f in dataclasses.fields(arg):
                meaning = docs.get(f.name, "").replace("|", "\\|")
                lines.append(
                    f"| `{f.name}` | `{_type_name(arg, f.name)}` | `{_default(f)}` | {meaning} |"
                )
            pending.extend(typing.get_type_hints(arg)[f.name] for f in dataclasses.fields(arg))
    return lines


if __name__ == "__main__":
    sys.stdout.write(config_reference_markdown())
