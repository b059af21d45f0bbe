"""The config reference (docs/config.md), generated from the sections' attribute docstrings.

Regenerate with `python -m kempnerforge.config.reference > docs/config.md`; a test fails
when the committed page and the code disagree.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys

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
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory
        if not isinstance(cls, type):
            raise TypeError(f"JobConfig.{section.name} has no section class as its default")
        docs = field_docs(cls)
        lines += ["", f"## [{section.name}]", ""]
        lines += ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for f in dataclasses.fields(cls):
            meaning = docs.get(f.name, "").replace("|", "\\|")
            lines.append(
                f"| `{f.name}` | `{_type_name(cls, f.name)}` | `{_default(f)}` | {meaning} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(config_reference_markdown())
