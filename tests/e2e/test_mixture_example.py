"""The worked mixture example runs as its config header and docs/data.md say.

The commands are read from the header of configs/train/mixture.toml, so the documented
recipe cannot drift from one that works; only the run is shortened.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import config_header
from tests.support.metrics_rows import read_rows
from tests.support.threads import PROCESS_THREADS

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
CONFIG = REPO / "configs" / "train" / "mixture.toml"
SHORT_RUN = [
    "--train.max_steps=6",
    "--scheduler.warmup_steps=2",
    "--eval.interval=3",
    "--eval.steps=2",
    "--metrics.log_interval=1",
    "--metrics.progress=off",
    "--train.sample_tokens=5",
    "--train.phases=[{start_step=3, dataset_weights={tests=3.0}, lr_scale=0.5}]",
]


def header_commands() -> list[str]:
    return config_header.header_commands(CONFIG, (".venv/", "STDLIB="))


def test_the_docs_show_the_same_commands_as_the_config_header():
    docs = (REPO / "docs" / "data.md").read_text().replace("\\\n", " ")
    docs = re.sub(r"[ ]+", " ", docs)
    for command in header_commands():
        assert re.sub(r"[ ]+", " ", command) in docs, command


def test_the_worked_example_prepares_and_trains(tmp_path):
    commands = header_commands()
    assert len(commands) == 4 and commands[-1].endswith("train configs/train/mixture.toml")
    kempnerforge = f"{sys.executable} -m kempnerforge"
    script = "\n".join(
        c.replace(".venv/bin/python", sys.executable)  # first: sys.executable may contain it
        .replace(".venv/bin/kempnerforge", kempnerforge)
        .replace("configs/train/mixture.toml", str(CONFIG))
        for c in commands
    )
    script = "set -e\n" + script + " " + " ".join(f"'{a}'" for a in SHORT_RUN)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": PROCESS_THREADS,
        "KEMPNERFORGE_CACHE": str(tmp_path / "cache"),
    }
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        ["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(tmp_path / "runs/debug-mixture")
    train = [r for r in rows if "loss" in r and "event" not in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for row in train:
        assert row["tokens/lib"] + row["tokens/tests"] == 8 * 256
    assert [(r["step"], r["lr_scale"]) for r in rows if r.get("event") == "phase"] == [(3, 0.5)]
    evals = [r for r in rows if "eval_loss" in r and "event" not in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert all("eval_loss/lib" in r and "eval_loss/tests" in r for r in evals)
    assert "finished at step 6" in result.stdout
