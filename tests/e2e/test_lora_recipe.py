"""The LoRA recipe as configs/train/lora_chat.toml's header runs it (shortened, on a tiny model
trained from scratch instead of the pretrained debug model): adapters on every projection
fine-tune on the arithmetic conversations, the frozen base never moves, and the adapters
export as a peft adapter folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.metrics_rows import train_rows
from tests.support.recipe_runs import REPO, SEQ, TINY_MODEL, assert_docs_show_header, run_python

pytestmark = pytest.mark.slow

MODEL = [
    *TINY_MODEL,
    "--train.max_steps=30",
    "--checkpoint.resume_from=none",
    "--checkpoint.load_weights_only=false",
]


def test_the_docs_show_the_commands_of_the_config_header():
    assert_docs_show_header("lora_chat.toml", 2)


def _run(tmp_path: Path, *args: str) -> None:
    run_python(tmp_path, *args)


def test_the_lora_recipe_trains_the_adapters_and_exports_them(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    _run(
        tmp_path, "-m", "examples.chat_conversations", "--output", "data/a.jsonl", "--count", "400"
    )
    _run(
        tmp_path, "-m", "kempnerforge", "prepare-data", "--format", "chat", "--seq-len",
        str(SEQ), "--input", "data/a.jsonl", "--output", "data/chat",
    )  # fmt: skip
    _run(tmp_path, "-m", "kempnerforge", "train", "configs/train/lora_chat.toml", *MODEL)
    rows = train_rows(tmp_path / "runs/lora-chat")
    assert [r["step"] for r in rows] == list(range(1, 31))
    first, last = rows[:5], rows[-5:]
    assert sum(r["loss"] for r in last) < sum(r["loss"] for r in first) - 5 * 0.3
    _run(
        tmp_path, "-m", "kempnerforge", "export", "--checkpoint", "runs/lora-chat", "--out",
        "runs/lora-chat/adapter", "--format", "peft",
    )  # fmt: skip
    adapter = tmp_path / "runs/lora-chat/adapter"
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert settings["r"] == 16 and settings["lora_alpha"] == 32.0
    assert len(settings["target_modules"]) == 2 * 7  # every projection of both blocks
    assert any(adapter.glob("adapter_model.*"))
