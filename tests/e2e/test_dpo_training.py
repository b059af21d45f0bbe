"""DPO through the command line: write arithmetic conversations and preference pairs (the
right answer chosen, a wrong one rejected), fine-tune the tiny model on the conversations,
prepare the pairs, train with train.loss_fn = "dpo" from the fine-tuned checkpoint (also the
reference): the reward accuracy rises and the margins grow; a run killed with SIGKILL and
relaunched logs the same losses and rewards as one that was not."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.metrics_rows import train_rows
from tests.support.recipe_runs import REPO, SEQ, TINY_MODEL, assert_docs_show_header, run_python

pytestmark = pytest.mark.slow

MODEL = [*TINY_MODEL, "--train.deterministic=true"]
DPO = [
    "--train.max_steps=32",
    "--optimizer.lr=1e-3",
    "--data.path=data/prefs",
    "--checkpoint.resume_from=runs/sft-chat/checkpoints/step_60",
]


def test_the_docs_show_the_commands_of_the_config_header():
    assert_docs_show_header("dpo_chat.toml", 3)


SIGKILL_HOOK = """
import os
import signal

from kempnerforge.training.hooks import TrainingHook


class KillAtStep20(TrainingHook):
    def on_step_end(self, ctx):
        if ctx.step == 20:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def _run(tmp_path: Path, *args: str, expect: int = 0) -> None:
    run_python(tmp_path, *args, expect=expect)


def _train(tmp_path: Path, config: str, *overrides: str, expect: int = 0) -> None:
    _run(tmp_path, "-m", "kempnerforge", "train", config, *MODEL, *overrides, expect=expect)


def test_dpo_raises_the_reward_accuracy_and_resumes_exactly(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    example = ["-m", "examples.chat_conversations", "--output"]
    _run(tmp_path, *example, "data/arith.jsonl", "--count", "600")
    # Few pairs, seen over many epochs: the tiny model learns to prefer their right answers.
    _run(tmp_path, *example, "data/prefs.jsonl", "--count", "32", "--preference")
    prepare = ["-m", "kempnerforge", "prepare-data", "--seq-len", str(SEQ), "--input"]
    _run(tmp_path, *prepare, "data/arith.jsonl", "--output", "data/chat", "--format", "chat")
    _run(tmp_path, *prepare, "data/prefs.jsonl", "--output", "data/prefs", "--format", "preference")
    sft = ["--train.max_steps=60", "--optimizer.lr=3e-3", "--train.batch_size=8"]
    sft += ["--checkpoint.resume_from=none", "--checkpoint.load_weights_only=false"]
    _train(tmp_path, "configs/train/sft_chat.toml", *sft)

    _train(tmp_path, "configs/train/dpo_chat.toml", *DPO)
    rows = train_rows(tmp_path / "runs/dpo-chat")
    assert [r["step"] for r in rows] == list(range(1, 33))
    # Step 1: the policy is the reference: every reward 0, the loss ln 2.
    assert rows[0]["rewards/margins"] == 0.0 and abs(rows[0]["loss"] - 0.6931) < 1e-4
    first, last = rows[:8], rows[-8:]

    def mean(chunk, key):
        return sum(r[key] for r in chunk) / len(chunk)

    assert mean(last, "rewards/accuracies") > mean(first, "rewards/accuracies") + 0.2
    assert mean(last, "rewards/margins") > mean(first, "rewards/margins") + 0.2
    assert mean(last, "loss") < mean(first, "loss") - 0.1

    # Killed with SIGKILL at the end of step 20 and relaunched: it resumes from its own
    # checkpoint of step 16 (the reference again from checkpoint.resume_from) and logs the
    # same losses and rewards, bitwise (deterministic CPU run), steps 17 to 20 twice.
    (tmp_path / "sigkill_hook.py").write_text(SIGKILL_HOOK)
    halves = ["--train.name=dpo-halves", "--checkpoint.interval=16"]
    kill = ["--train.hooks=['sigkill_hook:KillAtStep20']"]
    _train(tmp_path, "configs/train/dpo_chat.toml", *DPO, *halves, *kill, expect=-signal.SIGKILL)
    _train(tmp_path, "configs/train/dpo_chat.toml", *DPO, *halves)
    resumed = train_rows(tmp_path / "runs/dpo-halves")
    assert [r["step"] for r in resumed] == [*range(1, 21), *range(17, 33)]
    keys = ("loss", "grad_norm", "rewards/accuracies", "rewards/margins", "logps/chosen")
    for want, got in zip([*rows[:20], *rows[16:]], resumed, strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, got["step"]
