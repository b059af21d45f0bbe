"""docs/fault-tolerance.md's resume table names the fields the resume guard applies, logs and
refuses (training/resume_guard.py): the applied and operational rows list its lists exactly,
and every field the refused row names is one the guard refuses."""

from __future__ import annotations

import dataclasses
import pathlib
import re

from kempnerforge.config.reference import section_classes
from kempnerforge.training.resume_guard import APPLIED, BATCH_SPLIT, OPERATIONAL, kind_of

DOC = pathlib.Path(__file__).parents[2] / "docs" / "fault-tolerance.md"


def table_fields() -> dict[str, list[str]]:
    """Kind -> the dotted fields of its row, a section prefix as 'section.' (from
    `section.*`); a bare name belongs to the section last named before it in the row."""
    rows: dict[str, list[str]] = {}
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] not in ("applied", "operational", "refused"):
            continue
        section, fields = "", []
        for name in re.findall(r"`([^`]+)`", cells[1]):
            if name.endswith(".*"):
                section, name = name[:-2], name[:-1]
            elif "." in name:
                section = name.split(".", 1)[0]
            else:
                name = f"{section}.{name}"
            fields.append(name)
        rows[cells[0]] = fields
    return rows


def config_fields() -> set[str]:
    """Every dotted field of every config section, and each section as a prefix."""
    names = set()
    for section, cls in section_classes().items():
        names.add(f"{section}.")
        names.update(f"{section}.{f.name}" for f in dataclasses.fields(cls))
    return names


def test_the_table_has_the_three_kinds():
    assert set(table_fields()) == {"applied", "operational", "refused"}


def test_the_applied_and_operational_rows_list_the_guards_fields():
    rows = table_fields()
    assert sorted(rows["applied"]) == sorted(APPLIED)
    assert sorted(rows["operational"]) == sorted(OPERATIONAL)


def test_every_field_the_refused_row_names_is_refused():
    refused = table_fields()["refused"]
    for name in refused:
        assert kind_of(name) == "refused", name
    assert set(BATCH_SPLIT) <= set(refused)


def test_every_field_the_table_names_exists():
    known = config_fields()
    for kind, names in table_fields().items():
        assert set(names) <= known, (kind, sorted(set(names) - known))
