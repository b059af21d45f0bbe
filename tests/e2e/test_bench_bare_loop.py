"""bench/bare_loop.py, the baseline of bench/throughput.py, stays plain PyTorch and runs
(its speed is measured by hand, see docs/performance.md; no timing is asserted here)."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

BARE_LOOP = pathlib.Path(__file__).parents[2] / "bench" / "bare_loop.py"


def test_the_bare_loop_imports_nothing_from_kempnerforge():
    tree = ast.parse(BARE_LOOP.read_text())
    modules = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    modules += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert modules and not [m for m in modules if m.split(".")[0] == "kempnerforge"]


def test_the_bare_loop_trains_and_prints_its_figures(tmp_path):
    tokens = tmp_path / "tokens.bin"
    (np.arange(4096) % 259).astype(np.uint16).tofile(tokens)  # ids of the default vocab
    args = ["--dim=32", "--n-heads=2", "--n-kv-heads=1", "--ffn-hidden=64", "--n-layers=2"]
    args += ["--seq-len=16", "--batch-size=2", "--steps=4", "--skip=1", f"--tokens={tokens}"]
    proc = subprocess.run(
        [sys.executable, str(BARE_LOOP), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["tokens_per_sec"] > 0 and figures["peak_rss_gib"] > 0
