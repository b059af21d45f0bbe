"""The layout sweep holds validation to what was trained: every layout of 2 to 4 processes
that a launch accepts, for each config in variants.py, is one that trained as one process
in `make test-layouts` (recorded in checked.txt). A sample of the sweep runs in
tests/e2e/test_check_parallel.py."""

from __future__ import annotations

from collections import defaultdict

import pytest

from kempnerforge.commands.check_parallel import main as check_parallel
from tests.layouts.run_sweep import RECORD
from tests.layouts.variants import VARIANTS, sweep_argv


def recorded_layouts() -> dict[str, set[str]]:
    """checked.txt as {variant: layouts that passed}."""
    record: dict[str, set[str]] = defaultdict(set)
    for line in RECORD.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            variant, layout = line.split()
            record[variant].add(layout)
    return record


def accepted_layouts(variant: str, capsys) -> set[str]:
    """The layouts a launch of ``variant`` accepts, from check-parallel's dry run."""
    assert check_parallel(sweep_argv(variant, "--dry-run")) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("accepted ("))
    return set(line.split(":", 1)[1].split())


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_validation_accepts_only_layouts_the_sweep_trained_as_one_process(variant, capsys):
    """A rule loosened (or a layout newly admitted) fails here until `make test-layouts`
    trains it as one process and records it."""
    accepted = accepted_layouts(variant, capsys)
    trained = recorded_layouts()[variant]
    assert accepted - trained == set(), "accepted but never trained: run make test-layouts"
    assert trained - accepted == set(), "trained but now refused: run make test-layouts"


def test_the_sweep_once_found_a_zero_bubble_schedule_under_context_parallelism(capsys):
    """pp 2 x cp 2 with 'zbv' trained wrong (loss off by 1e-2) while validation took it."""
    accepted = accepted_layouts("dense-accum", capsys)
    assert "pp=2,cp=2,schedule=1f1b" in accepted
    for schedule in ("interleaved_zb", "zbv", "dualpipev"):
        assert f"pp=2,cp=2,schedule={schedule}" not in accepted
