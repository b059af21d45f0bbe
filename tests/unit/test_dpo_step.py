"""A DPO step through the real loop: the batch stream adds the frozen reference's
log-probabilities, text_step reads the objective, and the logged loss, rewards and gradient
norm equal the DPO formulas evaluated by hand on the same micro-batches with a policy and a
reference of their own."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.heads import IGNORE_INDEX
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.objectives import REF_LOGPS
from tests.support.chat_files import example_preference_corpus
from tests.support.metrics_rows import train_rows
from tests.support.tiny import preference_run

SEQ = 96
BETA = 0.5


def _logps(model, batch, with_doc_ids: bool) -> torch.Tensor:
    doc_ids = batch.get("doc_ids") if with_doc_ids else None
    logits = model(batch["input_ids"], doc_ids=doc_ids).float()
    labels = batch["labels"]
    per_token = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none", ignore_index=IGNORE_INDEX
    ).view(labels.shape)
    return -per_token.sum(dim=1)


def test_a_dpo_step_logs_the_loss_and_rewards_of_its_pairs(tmp_path):
    example_preference_corpus(tmp_path, 8, SEQ)
    config = load_config(
        None,
        preference_run(
            tmp_path / "run", tmp_path / "prefs", SEQ, f"--dpo.beta={BETA}",
            "--train.max_steps=1", "--train.grad_accum_steps=2", "--train.grad_clip_norm=0",
        ),
    )  # fmt: skip
    session = build_session(config, RuntimeContext())
    reference = copy.deepcopy(session.model)  # the seed's weights, as the live reference's
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # the policy moved away from its reference, as after some training
        for param in session.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=generator))
    policy = copy.deepcopy(session.model)
    seen = []
    step_batches = session.batches.step_batches

    def recording(count):
        batches = step_batches(count)
        seen.extend({k: v.clone() for k, v in b.items()} for b in batches)
        return batches

    session.batches.step_batches = recording  # type: ignore[method-assign]
    run_training_loop(session)
    session.tracker.close()
    (row,) = train_rows(config.run_dir)

    assert len(seen) == 2 and all(b["input_ids"].shape[0] == 4 for b in seen)  # 2 pairs each
    masked = config.data.document_masking
    pairs, loss_sum, margins, accurate = 0, torch.zeros((), dtype=torch.float64), 0.0, 0
    for batch in seen:
        with torch.no_grad():
            ref = _logps(reference, batch, with_doc_ids=False)
        # The stream's reference log-probabilities are the seed weights' (same forward).
        assert torch.allclose(batch[REF_LOGPS], ref, rtol=1e-6, atol=1e-5)
        chosen, rejected = (_logps(policy, batch, masked) - ref).chunk(2)
        delta = BETA * (chosen - rejected)
        loss_sum = loss_sum + (-F.logsigmoid(delta)).sum().double()
        margins += float(delta.sum())
        accurate += int((delta > 0).sum())
        pairs += len(delta)
    (loss_sum / pairs).backward()
    norm = torch.cat([p.grad.flatten() for p in policy.parameters() if p.grad is not None]).norm()

    assert row["supervised_tokens"] == pairs == 4
    # The same operations on the same weights, summed in another order: float32 ulps of
    # log-probabilities near -100 (rel 1e-5), through the sigmoid.
    assert math.isclose(row["loss"], float(loss_sum / pairs), rel_tol=1e-5)
    assert math.isclose(row["rewards/margins"], margins / pairs, rel_tol=1e-4, abs_tol=1e-5)
    assert row["rewards/accuracies"] == accurate / pairs
    assert abs(row["loss"] - math.log(2)) > 1e-3  # the policy is not its reference
    assert math.isclose(row["grad_norm"], float(norm), rel_tol=1e-4)


def test_simpo_trains_on_pairs_without_a_reference(tmp_path, caplog):
    """dpo.loss_type = "simpo" builds no reference (SimPO has none) and trains on the pairs;
    its rewards are beta times the responses' mean log-probabilities per token."""
    caplog.set_level(logging.INFO)
    example_preference_corpus(tmp_path, 8, SEQ)
    config = load_config(
        None,
        preference_run(
            tmp_path / "run", tmp_path / "prefs", SEQ, "--dpo.loss_type=simpo",
            "--dpo.beta=2.0", "--train.max_steps=2",
        ),
    )  # fmt: skip
    session = build_session(config, RuntimeContext())
    run_training_loop(session)
    session.tracker.close()
    assert "reference weights from" not in caplog.text
    rows = train_rows(config.run_dir)
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
    for row in rows:  # a mean log-probability per token of a byte-level response
        assert -20 < row["logps/chosen"] < 0
        assert math.isclose(row["rewards/chosen"], 2.0 * row["logps/chosen"], rel_tol=1e-9)
    with pytest.raises(ConfigError, match="dpo.reference"):
        load_config(None, ["--dpo.loss_type=simpo", "--dpo.reference=stored"])
