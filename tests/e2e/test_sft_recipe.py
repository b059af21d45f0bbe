"""The fine-tuning recipe runs as configs/train/sft_chat.toml's header and docs/training.md
say: pretrain, write conversations, prepare them packed, fine-tune from the pretrained
weights. The commands are read from the config's header, so the documented recipe cannot
drift from one that works; only the runs are shortened and the model shrunk."""

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
from tests.support.tiny import TINY_MODEL

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
CONFIG = REPO / "configs" / "train" / "sft_chat.toml"
SHORT = [
    *TINY_MODEL,
    "--model.n_kv_heads=2",
    "--model.max_seq_len=256",
    "--train.batch_size=2",
    "--eval.steps=2",
]
SHORT += ["--metrics.log_interval=1", "--metrics.progress=off", "--train.sample_tokens=4"]


def header_commands() -> list[str]:
    return config_header.header_commands(CONFIG)


def test_the_docs_show_the_same_commands_as_the_config_header():
    docs = re.sub(r"[ ]+", " ", (REPO / "docs" / "training.md").read_text())
    for command in header_commands():
        assert re.sub(r"[ ]+", " ", command) in docs, command


def test_the_recipe_pretrains_prepares_and_fine_tunes_on_the_assistant_tokens(tmp_path):
    pretrain, write, prepare, tune = header_commands()
    kempnerforge = f"{sys.executable} -m kempnerforge"

    def shell(command: str) -> str:
        return command.replace(".venv/bin/python", sys.executable).replace(
            ".venv/bin/kempnerforge", kempnerforge
        )

    script = [
        "set -e",
        shell(pretrain) + " " + " ".join([*SHORT, "--train.max_steps=4"]),
        shell(write).replace("--count 4000", "--count 200"),
        shell(prepare),
        shell(tune)
        + " "
        + " ".join(
            [
                *SHORT,
                "--train.max_steps=6",
                "--eval.interval=3",
                "--checkpoint.resume_from=runs/debug/checkpoints/step_4",
            ]
        ),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": PROCESS_THREADS,
        "KEMPNERFORGE_CACHE": str(tmp_path / "cache"),
    }
    env["PYTHONPATH"] = str(REPO)
    (tmp_path / "configs").symlink_to(REPO / "configs")
    result = subprocess.run(
        ["bash", "-c", "\n".join(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_rows(tmp_path / "runs/sft-chat")
    events = {r["event"]: r for r in rows if "event" in r}
    # The pretrained weights only, and a fresh start at step 0.
    assert events["load_weights"]["path"] == "runs/debug/checkpoints/step_4"
    assert events["load_weights"]["step"] == 0 and "resume" not in events
    train = [r for r in rows if "loss" in r and "event" not in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    evals = [r for r in rows if "eval_loss" in r and "event" not in r]
    assert [r["step"] for r in evals] == [3, 6]
    assert "packed into windows of 256" in result.stdout
