"""The SLURM job scripts parse as bash (their behaviour: tests/e2e/test_slurm_script.py)."""

from __future__ import annotations

import pathlib
import subprocess

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).parents[2] / "scripts" / "slurm").glob("*.sbatch"))


def test_there_is_a_job_script():
    assert [p.name for p in SCRIPTS] == ["ft_groups.sbatch", "train.sbatch"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_job_script_is_valid_bash(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
