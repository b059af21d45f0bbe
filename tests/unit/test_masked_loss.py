"""Training and eval on a loss-masked corpus: the loss counts the assistant's tokens only, so
what the user says after the last reply changes neither the loss, nor the gradients, nor
the token count."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.data.dataset import MemoryMappedDataset
from kempnerforge.data.tokens.token_file import read_meta
from kempnerforge.data.tokens.token_flags import FLAGS_FILE, LOSS_ON
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.accumulate import step_tokens
from kempnerforge.training.build import build_session
from kempnerforge.training.eval import evaluate
from tests.support.chat_files import turns, write_masked_dir
from tests.support.tiny import tiny_run

EOS = 257  # ByteTokenizer's: the end of the assistant's turn, inside the conversation
NUM_TOKENS = 8 * 32 + 1  # exactly 8 windows of train.seq_len 32: every token read once


def write_chats(path: Path, last_user_seed: int, reply_seed: int = 0) -> str:
    """Conversations of a user turn, a reply ending in EOS and a last user turn, 257 tokens
    in all; ``last_user_seed`` draws the last user turns, ``reply_seed`` the replies."""
    turn_ids, reply_ids = np.random.default_rng(0), np.random.default_rng(reply_seed)
    last_ids = np.random.default_rng(last_user_seed)
    chats = []
    for k in range(16):  # 16 tokens each, the last 17: 257
        user = turn_ids.integers(0, 128, 4).tolist()
        reply = [*reply_ids.integers(128, 256, 5).tolist(), EOS]
        last = last_ids.integers(0, 128, 7 if k == 15 else 6).tolist()
        chats.append(turns((user, False), (reply, True), (last, False)))
    assert sum(len(ids) for ids, _ in chats) == NUM_TOKENS
    return write_masked_dir(path, chats)


def _session(run_dir: Path, data_dir: str):
    config = load_config(
        None,
        tiny_run(run_dir, (data_dir, data_dir), "--data.shuffle=false", "--eval.steps=2"),
    )
    config.validate(1)
    return build_session(config, RuntimeContext())


def _step_and_eval(run_dir: Path, data_dir: str) -> tuple[float, dict[str, float]]:
    """The first training step's loss, then eval over the whole corpus (8 windows)."""
    loss, _, metrics = _step_grads_and_eval(run_dir, data_dir)
    return loss, metrics


def _step_grads_and_eval(
    run_dir: Path, data_dir: str
) -> tuple[float, list[torch.Tensor], dict[str, float]]:
    """The first training step's loss and gradients, and eval over the whole corpus."""
    session = _session(run_dir, data_dir)
    metrics = evaluate(session.model, session.data, session.config, session.runtime)
    loss = session.step_fn(session, 1).loss
    grads = [p.grad.clone() for p in session.model.parameters() if p.grad is not None]
    return loss, grads, metrics


def test_the_loss_ignores_the_user_turn_no_reply_follows(tmp_path):
    """Its tokens are targets of no loss and, with document masking, reach no position whose
    loss counts: the same operations on the same values give the same loss, exactly."""
    base = write_chats(tmp_path / "a", last_user_seed=1)
    other_user = write_chats(tmp_path / "b", last_user_seed=2)
    other_reply = write_chats(tmp_path / "c", last_user_seed=1, reply_seed=3)
    tokens = [np.fromfile(Path(p) / "tokens.bin", dtype="<u2") for p in (base, other_user)]
    assert not np.array_equal(*tokens)  # the test changes something

    loss, grads, metrics = _step_grads_and_eval(tmp_path / "run-a", base)
    same_loss, same_grads, same_metrics = _step_grads_and_eval(tmp_path / "run-b", other_user)
    assert same_loss == loss
    assert grads and len(same_grads) == len(grads)
    assert all(torch.equal(a, b) for a, b in zip(grads, same_grads, strict=True))
    assert same_metrics == metrics
    # The replies are what is learned: changing one changes the loss.
    changed_loss, changed_metrics = _step_and_eval(tmp_path / "run-c", other_reply)
    assert changed_loss != pytest.approx(loss, abs=1e-4)
    assert changed_metrics["eval_loss"] != pytest.approx(metrics["eval_loss"], abs=1e-4)


def test_the_supervised_tokens_are_the_mask_on_tokens(tmp_path):
    path = write_chats(tmp_path / "a", last_user_seed=1)
    flags = np.fromfile(Path(path) / FLAGS_FILE, dtype=np.uint8)
    # The step's count (the loss's normaliser) over the first training batch, windows 0..3.
    dataset = MemoryMappedDataset(path, seq_len=32)
    batch = {k: torch.stack([dataset[i][k] for i in range(4)]) for k in dataset[0]}
    count = step_tokens(RuntimeContext(), [batch]).count.item()
    assert count == int(np.count_nonzero(flags[1 : 4 * 32 + 1] & LOSS_ON))
    # The step reports that count, which the loop logs as supervised_tokens.
    session = _session(tmp_path / "step", path)
    assert session.step_fn(session, 1).text_tokens == count
    # Eval over the whole corpus counts each mask-on token once (the first token is a user's).
    _, metrics = _step_and_eval(tmp_path / "run", path)
    assert metrics["eval_tokens"] == read_meta(path)["assistant_tokens"] == 16 * 6
