"""The exit codes every table and help text lists are resilience/exit_codes.py's: each code
there appears, with its meaning, and no other code does."""

from __future__ import annotations

import pathlib
import re

import pytest

from kempnerforge.cli import main
from kempnerforge.resilience import exit_codes

REPO = pathlib.Path(__file__).parents[2]
TABLE_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
TABLE_FILES.append(REPO / "scripts" / "slurm" / "README.md")

MENTIONS = {
    0: ("finish",),
    1: ("fail",),
    2: ("config",),
    3: ("nan", "non-finite"),
    75: ("preempt",),
    76: ("hardware",),
    77: ("hang",),
    130: ("interrupt",),
}
"""What a table's row of each code must mention, so a row cannot describe another code."""

LEFT_OUT = {"scripts/slurm/README.md": {exit_codes.INTERRUPTED}}
"""Codes a table may leave out, by file: the SLURM script's table lists what a batch job
can see, and Ctrl-C (130) comes only from a terminal."""


def code_constants() -> dict[str, int]:
    """The module's exit codes by name: its upper-case integer constants."""
    return {
        name: value
        for name, value in vars(exit_codes).items()
        if name.isupper() and type(value) is int
    }


def code_tables(path: pathlib.Path) -> list[dict[int, str]]:
    """Each Markdown table of ``path`` whose first header cell is "code": code -> row."""
    tables: list[dict[int, str]] = []
    rows: dict[int, str] | None = None
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|"):
            rows = None
        elif rows is None and cells[0] == "code":
            rows = {}
            tables.append(rows)
        elif rows is not None and cells[0].isdigit():
            rows[int(cells[0])] = line
    return tables


def test_every_code_has_a_summary_and_a_paragraph_in_the_module_doc():
    codes = code_constants()
    assert set(exit_codes.SUMMARY) == set(codes.values()) == set(MENTIONS)
    doc = exit_codes.__doc__ or ""
    for name, code in codes.items():
        assert re.search(rf"^{name} \({code}\b", doc, re.MULTILINE), name


def test_train_help_lists_every_code_and_no_other(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    listed = text.split("Exit codes: ", 1)[1]
    assert [int(c) for c in re.findall(r"(?:^|, )(\d+) ", listed)] == list(exit_codes.SUMMARY)
    for code, meaning in exit_codes.SUMMARY.items():
        assert f"{code} {meaning}" in listed


@pytest.mark.parametrize("path", TABLE_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_exit_code_table_lists_the_codes_of_exit_codes_py(path):
    name = str(path.relative_to(REPO))
    expected = set(exit_codes.SUMMARY) - LEFT_OUT.get(name, set())
    for rows in code_tables(path):
        assert set(rows) == expected, f"{name}: codes {sorted(rows)}, expected {sorted(expected)}"
        for code, row in rows.items():
            words = MENTIONS[code]
            assert any(w in row.lower() for w in words), f"{name}: row {code} names none of {words}"


def test_the_readme_and_the_fault_tolerance_guide_each_have_a_table():
    assert len(code_tables(REPO / "README.md")) == 1
    assert len(code_tables(REPO / "docs" / "fault-tolerance.md")) == 1
