"""GRPO through the command line, as configs/train/grpo_arithmetic.toml's header runs it (shortened,
on a tiny model): write arithmetic conversations and prompts, fine-tune on the conversations,
prepare the prompts, train with train.loss_fn = "grpo" from the fine-tuned checkpoint. A run
killed with SIGKILL while it samples a rollout, relaunched, resumes from its checkpoint in
the middle of an earlier rollout and logs the same losses, gradient norms and rewards as a
run that was not stopped, bitwise."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.metrics_rows import train_rows
from tests.support.recipe_runs import REPO, SEQ, TINY_MODEL, assert_docs_show_header, run_python

pytestmark = pytest.mark.slow

MODEL = [*TINY_MODEL, "--train.deterministic=true"]
GRPO = [
    "--train.max_steps=8",
    "--train.batch_size=4",
    "--train.grad_accum_steps=2",
    "--grpo.group_size=4",
    "--grpo.iterations=2",
    "--grpo.max_new_tokens=10",
    "--grpo.kl_beta=0.05",
    "--optimizer.lr=1e-3",
    "--data.path=data/prompts",
    "--checkpoint.resume_from=runs/sft-chat/checkpoints/step_60",
    "--checkpoint.interval=3",
    "--grpo.reward=stopping_reward:reward",
]
# The exact-answer checker, plus a share for odd lengths (an SFT model this small gets few
# sums right, and the test needs rewards that differ within groups); with stop_at present,
# the call that reaches its count deletes it and kills the process with SIGKILL.
STOPPING_REWARD = """
import os
import signal

from kempnerforge.training.objectives import exact_answer

calls = 0


def reward(completion, answer, prompt):
    global calls
    calls += 1
    if os.path.exists("stop_at") and calls == int(open("stop_at").read()):
        os.remove("stop_at")
        os.kill(os.getpid(), signal.SIGKILL)
    return exact_answer(completion, answer, prompt) + 0.1 * (len(completion) % 2)
"""


def test_the_docs_show_the_commands_of_the_config_header():
    assert_docs_show_header("grpo_arithmetic.toml", 3)


def _run(tmp_path: Path, *args: str, expect: int = 0) -> None:
    run_python(tmp_path, *args, expect=expect)


def _train(tmp_path: Path, config: str, *overrides: str, expect: int = 0) -> None:
    _run(tmp_path, "-m", "kempnerforge", "train", config, *MODEL, *overrides, expect=expect)


def test_grpo_killed_while_sampling_resumes_to_the_same_losses(tmp_path):
    (tmp_path / "configs").symlink_to(REPO / "configs")
    (tmp_path / "stopping_reward.py").write_text(STOPPING_REWARD)
    example = ["-m", "examples.chat_conversations", "--output"]
    _run(tmp_path, *example, "data/arith.jsonl", "--count", "600")
    _run(tmp_path, *example, "data/prompts.jsonl", "--count", "64", "--prompts")
    prepare = ["-m", "kempnerforge", "prepare-data", "--seq-len", str(SEQ), "--input"]
    _run(tmp_path, *prepare, "data/arith.jsonl", "--output", "data/chat", "--format", "chat")
    prompts = ["data/prompts.jsonl", "--output", "data/prompts", "--format", "prompts"]
    _run(tmp_path, *prepare, *prompts)
    sft = ["--train.max_steps=60", "--optimizer.lr=3e-3", "--train.batch_size=8"]
    sft += ["--checkpoint.resume_from=none", "--checkpoint.load_weights_only=false"]
    _train(tmp_path, "configs/train/sft_chat.toml", *sft)

    config = "configs/train/grpo_arithmetic.toml"
    _train(tmp_path, config, *GRPO)
    rows = train_rows(tmp_path / "runs/grpo-arithmetic")
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["grpo/completion_tokens"] > 0 for r in rows)
    assert any(r["grpo/reward_std"] > 0 for r in rows)
    assert rows[1]["grpo/reward"] == rows[0]["grpo/reward"]  # one rollout, two steps
    assert rows[0]["grpo/kl"] == 0.0 and rows[-1]["grpo/kl"] > 0.0  # the policy moved away

    # 8 completions a rollout: call 20 is the third rollout's (steps 5 and 6). The launch
    # dies there; its last checkpoint, step 3, is in the middle of the second rollout.
    (tmp_path / "stop_at").write_text("20")
    halves = ["--train.name=grpo-killed"]
    _train(tmp_path, config, *GRPO, *halves, expect=-signal.SIGKILL)
    assert not (tmp_path / "stop_at").exists()
    killed = train_rows(tmp_path / "runs/grpo-killed")
    assert [r["step"] for r in killed] == [1, 2, 3, 4]
    _train(tmp_path, config, *GRPO, *halves)
    logged = train_rows(tmp_path / "runs/grpo-killed")
    # The relaunch resumed from step 3 and logs step 4 again, then 5 to 8.
    assert [r["step"] for r in logged] == [1, 2, 3, 4, 4, 5, 6, 7, 8]
    keys = ("loss", "grad_norm", "grpo/reward", "grpo/kl", "grpo/clip_ratio", "supervised_tokens")
    for want, got in zip([*rows[:4], *rows[3:]], logged, strict=True):
        assert {k: got[k] for k in keys} == {k: want[k] for k in keys}, got["step"]
