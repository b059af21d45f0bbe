"""scripts/slurm/ft_groups.sbatch without SLURM, as its header's first example submits it:
the batch script run by bash with a stand-in srun (each group ends at once), and a real
lighthouse. Its log's first line says which join timeout the lighthouse took, from the
step times the job's run directory holds, though the example names no run directory.
(A real SLURM runs the groups in tests/slurm/test_ft_groups_sbatch.py.)"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from kempnerforge.commands.lighthouse import JOIN_TIMEOUT_STEPS

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("torchft") is None, reason="the lighthouse needs the ft extra"
    ),
]

REPO = pathlib.Path(__file__).parents[2]
SCRIPT = REPO / "scripts" / "slurm" / "ft_groups.sbatch"
FAKE_SRUN = """#!/bin/bash
exec 9>> "$SRUN_LOG.lock"
flock 9
printf '%q ' srun "$@" >> "$SRUN_LOG"
echo >> "$SRUN_LOG"
"""
"""srun for one node: records its command line (one line, quoted; the groups' sruns run
side by side, so each holds a lock while it writes, else their lines interleave) and ends
the group at once, as a finished run does (exit 0)."""


def header_example() -> tuple[dict[str, str], list[str], list[str]]:
    """The script header's first example: (its environment, sbatch's options, the script's
    arguments)."""
    lines = SCRIPT.read_text().splitlines()
    start = lines.index("#   mkdir -p logs") + 1
    joined = ""
    for line in lines[start:]:
        text = line.removeprefix("#").strip()
        joined += " " + text.rstrip("\\")
        if not text.endswith("\\"):
            break
    tokens = shlex.split(joined, comments=True)
    env = {}
    while "=" in tokens[0] and not tokens[0].startswith("-"):
        name, value = tokens.pop(0).split("=", 1)
        env[name] = value
    assert tokens.pop(0) == "sbatch", joined
    at = tokens.index("scripts/slurm/ft_groups.sbatch")
    return env, tokens[:at], tokens[at + 1 :]


def run_example(
    tmp_path: pathlib.Path, arguments: list[str] | None = None, **extra_env: str
) -> subprocess.CompletedProcess:
    """The example's batch script on one node; ``arguments`` replace the script's."""
    env_of_example, options, example_arguments = header_example()
    assert options == ["--nodes=1"], options
    arguments = example_arguments if arguments is None else arguments
    (tmp_path / "configs").symlink_to(REPO / "configs")
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "srun").write_text(FAKE_SRUN)
    (tools / "srun").chmod(0o755)
    env = {
        **os.environ,
        **env_of_example,
        "PATH": f"{tools}:{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),
        "VENV": str(tmp_path / "no-venv"),  # nothing to activate: PATH is set above
        "SLURM_JOB_ID": "7",
        "SLURM_NNODES": "1",
        "SRUN_LOG": str(tmp_path / "srun.log"),
        **extra_env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), *arguments],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_header_example_sizes_the_join_timeout_from_its_config_run_directory(tmp_path):
    # The example names no run directory: the job's is the config's, runs/debug, where an
    # earlier allocation of this job left its groups' rows (a median step of 2 s).
    rows = tmp_path / "runs" / "debug" / "replica_0" / "metrics.jsonl"
    rows.parent.mkdir(parents=True)
    rows.write_text("".join(json.dumps({"step": s, "step_time_s": 2.0}) + "\n" for s in (1, 2)))
    done = run_example(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    timeout_ms = int(JOIN_TIMEOUT_STEPS * 2.0 * 1000)
    assert first == (
        f"lighthouse: join timeout {timeout_ms} ms ({JOIN_TIMEOUT_STEPS:g} x the median step "
        "time 2.000 s of 2 rows in runs/debug, at least --join-timeout-ms = 1000)"
    ), done.stdout
    groups = (tmp_path / "srun.log").read_text().splitlines()
    assert len(groups) == 2 and all("--fault_tolerance.num_replica_groups=2" in g for g in groups)
    assert done.stdout.rstrip().endswith("training finished")


def test_a_first_start_and_run_dir_say_where_the_timeout_came_from(tmp_path):
    done = run_example(tmp_path, RUN_DIR="runs/elsewhere")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[0] == (
        "lighthouse: join timeout 1000 ms (no step times in runs/elsewhere yet: --join-timeout-ms)"
    )


def test_a_config_that_does_not_load_stops_the_job_with_one_line(tmp_path):
    done = run_example(tmp_path, ["configs/train/missing.toml"])
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "kempnerforge: error: <config file> = 'configs/train/missing.toml': expected an "
        "existing TOML file"
    ]
    assert not (tmp_path / "srun.log").exists()  # no group started
