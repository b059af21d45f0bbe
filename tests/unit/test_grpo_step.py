"""GRPO through the real build and loop on the tiny model: the rollout stream samples groups of
completions of prepared prompts with the policy, a user's reward (module:function) scores
them, and the logged loss, gradient norm and reward equal the objective computed by hand on
the same rows with the starting weights; a rollout serves grpo.iterations steps, then the
next prompts are sampled; a session resumed from the checkpoint of a step in the middle of
a rollout trains on the same rows to the same losses, bitwise."""

from __future__ import annotations

import copy
import random
import textwrap

import pytest
import torch

from examples.chat_conversations import prompt_row
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.data.chat import load_chat_template
from kempnerforge.data.prepare import write_prompts_corpus
from kempnerforge.data.tokenizer import load_tokenizer
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.heads import IGNORE_INDEX, logits_head_loss
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.objectives.grpo import ADVANTAGES, OLD_LOGPS, REWARDS
from kempnerforge.training.resume_plan import resume_session
from tests.support.chat_files import write_conversations
from tests.support.metrics_rows import train_rows
from tests.support.tiny import tiny_run

SEQ = 64
REWARD_MODULE = """
def digits(completion, answer, prompt):
    # Varied rewards for an untrained model: how many digits the completion holds, mod 3.
    return float(sum(c.isdigit() for c in completion) % 3) + 0.25 * (len(completion) % 2)
"""


@pytest.fixture
def prompts_dir(tmp_path, monkeypatch):
    rows = [prompt_row(random.Random(seed)) for seed in range(24)]
    source = write_conversations(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "prompts"
    write_prompts_corpus(
        [str(source)], str(out), load_tokenizer("byte"), load_chat_template("byte"), SEQ
    )
    (tmp_path / "grpo_rewards_for_test.py").write_text(textwrap.dedent(REWARD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return out


def _config(tmp_path, prompts_dir, run: str, *extra: str):
    return load_config(
        None,
        tiny_run(
            tmp_path / run, None, f"--data.path={prompts_dir}", "--data.eval_path=",
            f"--train.seq_len={SEQ}", f"--model.max_seq_len={SEQ}", "--train.loss_fn=grpo",
            "--grpo.group_size=4", "--grpo.max_new_tokens=6", "--grpo.iterations=2",
            "--grpo.reward=grpo_rewards_for_test:digits", "--grpo.clip_low=0.1",
            "--train.grad_accum_steps=2", "--train.grad_clip_norm=0", "--eval.interval=0",
            "--optimizer.lr=3e-3", "--train.deterministic=true", *extra,
        ),
    )  # fmt: skip


def _record_batches(session) -> list[list[dict[str, torch.Tensor]]]:
    """Each step's micro-batches, copied as the step body reads them."""
    steps: list[list[dict[str, torch.Tensor]]] = []
    stream = session.batches
    step_batches = stream.step_batches

    def recording(count: int):
        batches = step_batches(count)
        steps.append([{k: v.clone() for k, v in b.items()} for b in batches])
        return batches

    stream.step_batches = recording
    return steps


def test_a_grpo_step_logs_the_objective_of_its_sampled_rows(tmp_path, prompts_dir):
    config = _config(tmp_path, prompts_dir, "run", "--train.max_steps=3")
    session = build_session(config, RuntimeContext())
    initial = copy.deepcopy(session.model)
    steps = _record_batches(session)
    run_training_loop(session)
    session.tracker.close()
    rows = train_rows(config.run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]

    first = steps[0]
    # 4 rows each, as wide as the rollout's longest row needs (at most the window).
    assert len(first) == 2 and all(b["input_ids"].shape[0] == 4 for b in first)
    assert 0 < first[0]["input_ids"].shape[1] <= SEQ
    # One rollout serves grpo.iterations = 2 steps; step 3 samples the next prompts.
    for a, b in zip(steps[0], steps[1], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(steps[2][0]["input_ids"], steps[0][0]["input_ids"])
    rewards = torch.cat([b[REWARDS] for b in first])
    assert rewards.unique().numel() > 1, "the test's reward should vary within the rollout"
    # A group's advantages are centred: they sum to 0 over its 4 completions.
    advantages = torch.cat([b[ADVANTAGES] for b in first]).view(-1, 4)
    torch.testing.assert_close(advantages.sum(dim=1), torch.zeros(2), atol=1e-5, rtol=0)

    # By hand on the starting weights: ratio exp(logp - old) is 1 up to the rounding of two
    # forwards, so each token's loss is -advantage (inside the clip band), and the step's
    # loss their mean over the completion tokens.
    tokens = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in first)
    total = torch.zeros((), dtype=torch.float64)
    initial.zero_grad()
    for batch in first:
        head = logits_head_loss(initial(batch["input_ids"]), batch["labels"], 0.0, True)
        mask = batch["labels"] != IGNORE_INDEX
        logps = -head.token_losses
        torch.testing.assert_close(logps * mask, batch[OLD_LOGPS], rtol=0, atol=1e-5)
        ratio = torch.exp((logps - batch[OLD_LOGPS]) * mask)
        loss = -(ratio * batch[ADVANTAGES][:, None] * mask).sum()
        (loss / tokens).backward()
        total += loss.detach().double()
    norm = torch.cat([p.grad.flatten() for p in initial.parameters() if p.grad is not None]).norm()
    assert rows[0]["supervised_tokens"] == tokens
    assert rows[0]["loss"] == pytest.approx(float(total / tokens), abs=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
    assert rows[0]["grpo/reward"] == pytest.approx(float(rewards.mean()), rel=1e-6)
    assert rows[0]["grpo/completion_tokens"] == pytest.approx(tokens / 8)
    assert rows[1]["grpo/reward"] == rows[0]["grpo/reward"]  # the same rollout
    assert rows[1]["loss"] != rows[0]["loss"]  # other weights: the ratio moved


def test_a_run_resumed_in_the_middle_of_a_rollout_trains_on_its_rows(tmp_path, prompts_dir):
    whole = _config(tmp_path, prompts_dir, "whole", "--train.max_steps=4")
    session = build_session(whole, RuntimeContext())
    run_training_loop(session)
    session.tracker.close()

    # Stopped after step 3: the second rollout has one of its two steps left.
    halves = ["--checkpoint.interval=3", "--checkpoint.async_mode=disabled"]
    first = _config(tmp_path, prompts_dir, "halves", "--train.max_steps=3", *halves)
    session = build_session(first, RuntimeContext())
    run_training_loop(session)
    session.tracker.close()
    second = _config(tmp_path, prompts_dir, "halves", "--train.max_steps=4", *halves)
    session = build_session(second, RuntimeContext())
    steps = _record_batches(session)
    step, tokens_seen = resume_session(session)
    assert step == 3
    run_training_loop(session, step=step, tokens_seen=tokens_seen)
    session.tracker.close()
    assert len(steps) == 1
    keys = ("loss", "grad_norm", "grpo/reward", "supervised_tokens")
    want, got = train_rows(whole.run_dir), train_rows(second.run_dir)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for a, b in zip(want, got, strict=True):
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]


def test_grpo_refuses_data_that_is_not_a_prompt_corpus(tmp_path, prompts_dir, token_dirs):
    config = _config(tmp_path, prompts_dir, "run", f"--data.path={token_dirs[0]}")
    with pytest.raises(ConfigError, match="prepare-data --format prompts"):
        build_session(config, RuntimeContext())
