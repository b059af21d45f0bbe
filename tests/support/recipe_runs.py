"""Running a worked recipe (a config under configs/train/ whose header lists its commands) in
a test: its commands as processes of their own in a scratch directory (`kempnerforge`
commands forked from the warm server, tests.support.warm_process), on a tiny model, and
the check that docs/training.md shows the same commands."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

from tests.support import config_header, warm_process
from tests.support.threads import PROCESS_THREADS

REPO = Path(__file__).parents[2]
SEQ = 96
TINY_MODEL = [
    "--model.dim=64",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.multiple_of=16",
    f"--model.max_seq_len={SEQ}",
    f"--train.seq_len={SEQ}",
    "--metrics.progress=off",
    "--train.sample_tokens=0",
    "--eval.interval=0",
    "--data.eval_path=",
    "--metrics.log_interval=1",
]
"""Overrides that shrink a recipe's run to a tiny model, every step logged, no eval or sample."""


def assert_docs_show_header(config: str, count: int) -> None:
    """configs/train/``config``'s header holds ``count`` commands, each shown in
    docs/training.md (runs of spaces aside)."""
    docs = re.sub(r"[ ]+", " ", (REPO / "docs" / "training.md").read_text())
    commands = config_header.header_commands(REPO / "configs" / "train" / config)
    assert len(commands) == count
    for command in commands:
        assert re.sub(r"[ ]+", " ", command) in docs, command


def run_python(tmp_path: Path, *args: str, expect: int = 0) -> None:
    """``python *args`` in ``tmp_path`` (the repository importable, a cache of its own, this
    worker's share of the cores); its exit code must be ``expect`` (a negative signal
    number for a kill)."""
    env = {**os.environ, "KEMPNERFORGE_CACHE": str(tmp_path / "cache")}
    env.update(OMP_NUM_THREADS=PROCESS_THREADS, PYTHONPATH=str(REPO))
    result = warm_process.run(
        [sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == expect, result.stderr[-3000:]
