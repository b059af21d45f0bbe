"""End to end: SIGKILL during an async checkpoint write, then an automatic resume.

The fault hook (KEMPNERFORGE_FAULT_SAVE_DELAY_S, from step 10 only) holds the save of
step 10 after its DCP files are written and before its marker; the test kills the run
there. The save of step 5 is not delayed, so it is committed before the kill.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import subprocess
import sys
import time

import pytest

from kempnerforge.data.prepare.corpus import prepare_data
from kempnerforge.data.tokenizer import ByteTokenizer
from tests.support.metrics_rows import events
from tests.support.threads import PROCESS_THREADS
from tests.support.tiny import tiny_run
from tests.support.warm_process import popen

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
DEBUG = str(REPO / "configs" / "train" / "debug.toml")


def _token_dir(root: pathlib.Path) -> str:
    """A few KB of generated text, tokenized with the byte tokenizer."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import"]
    source = root / "docs.jsonl"
    with open(source, "w") as f:
        for _ in range(200):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
            f.write(json.dumps({"text": text + "\n"}) + "\n")
    prepare_data([str(source)], str(root / "tokens"), ByteTokenizer())
    return str(root / "tokens")


def _train(run_dir: pathlib.Path, data: str, cache: pathlib.Path, **env: str):
    # The tiny model: what is under test is the checkpoint's commit, not the training.
    args = tiny_run(
        run_dir,
        None,
        "--model.n_kv_heads=2",  # the debug config's 4 do not divide the tiny model's heads
        "--checkpoint.interval=5",
        "--checkpoint.async_mode=async",
        "--train.max_steps=12",
        f"--data.path={data}",
        "--data.eval_path=",
        "--eval.interval=0",
    )
    return popen(
        [sys.executable, "-m", "kempnerforge", "train", DEBUG, *args],
        cwd=REPO,
        env={
            **os.environ,
            "OMP_NUM_THREADS": PROCESS_THREADS,
            "KEMPNERFORGE_CACHE": str(cache),
            **env,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _latest(checkpoints: pathlib.Path) -> str | None:
    try:
        return (checkpoints / "latest").read_text().strip()
    except FileNotFoundError:
        return None


def test_sigkill_mid_async_save_resumes_from_the_last_committed_checkpoint(tmp_path):
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    data = _token_dir(tmp_path)
    checkpoints = run_dir / "checkpoints"
    held = checkpoints / "step_10.tmp"
    first = _train(
        run_dir,
        data,
        cache,
        KEMPNERFORGE_FAULT_SAVE_DELAY_S="600",
        KEMPNERFORGE_FAULT_SAVE_DELAY_FROM_STEP="10",
    )
    try:
        deadline = time.monotonic() + 240
        # Step 10's DCP files are written (its .metadata is DCP's last file) and the
        # fault hook holds it before the marker: kill the run right there.
        while not ((held / ".metadata").is_file() and _latest(checkpoints) == "step_5"):
            assert first.poll() is None, first.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the run never reached the save of step 10"
            time.sleep(0.1)
        first.kill()
        first.communicate(timeout=60)
    finally:
        first.kill()
    assert first.returncode == -9
    assert _latest(checkpoints) == "step_5"
    assert (checkpoints / "step_5" / "complete.json").is_file()
    assert not (checkpoints / "step_10").exists()
    assert not (held / "complete.json").exists()

    second = _train(run_dir, data, cache)
    out, err = second.communicate(timeout=300)
    assert second.returncode == 0, err[-3000:]
    resumes = events(run_dir, "resume")
    assert [r["step"] for r in resumes] == [5]
    assert resumes[0]["path"] == str(checkpoints / "step_5")
    assert _latest(checkpoints) == "step_12"
    assert sorted(p.name for p in checkpoints.iterdir()) == [
        ".lock",  # the run's lock on its checkpoint directory
        "latest",
        "step_10",
        "step_12",
        "step_5",
    ]
