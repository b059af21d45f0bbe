"""The objective seam: a step body reads its loss and its normaliser from the job's objective
(train.loss_fn), so a new objective is one registration, not a branch in a step body."""

from __future__ import annotations

import copy

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.model.heads import IGNORE_INDEX, HeadLoss
from kempnerforge.training.build import build_session
from kempnerforge.training.loop import run_training_loop
from kempnerforge.training.objectives import OBJECTIVES, Batch, Objective, objective_of
from kempnerforge.training.preflight import preflight
from tests.support.metrics_rows import train_rows


def test_the_default_objective_is_token_cross_entropy(tiny_job_config):
    objective = objective_of(tiny_job_config)
    assert objective.name == "cross_entropy" and objective.logits_loss
    assert not objective.per_token_grad
    labels = torch.tensor([[1, IGNORE_INDEX, 3], [IGNORE_INDEX, IGNORE_INDEX, 5]])
    assert objective.count({"labels": labels}) == 3


def test_an_unknown_objective_is_refused_before_anything_is_built(tiny_overrides):
    config = load_config(None, [*tiny_overrides, "--train.loss_fn=cross_entropi"])
    with pytest.raises(ConfigError) as raised:
        preflight(config)
    message = str(raised.value)
    assert "train.loss_fn" in message and "cross_entropy" in message


def _supervised(batch: Batch) -> torch.Tensor:
    return (batch["labels"] != IGNORE_INDEX).sum(dim=1)


def sequence_count(batch: Batch) -> int:
    """Rows with at least one supervised token."""
    return int((_supervised(batch) > 0).sum())


def sequence_mean_loss(head: HeadLoss, batch: Batch) -> torch.Tensor:
    """Each row's mean token loss, summed over rows: the step's loss is their mean."""
    return (head.token_losses.sum(dim=1) / _supervised(batch).clamp(min=1)).sum()


@pytest.fixture
def sequence_mean():
    objective = Objective(
        "sequence_mean", loss=sequence_mean_loss, count=sequence_count, per_token_grad=True
    )
    OBJECTIVES.register("sequence_mean")(objective)
    yield objective
    OBJECTIVES.unregister("sequence_mean")


def _record_batches(session) -> list[Batch]:
    """Make the session's batch stream keep a copy of every micro-batch it hands out."""
    seen: list[Batch] = []
    stream = session.batches
    step_batches = stream.step_batches

    def recording(count: int) -> list[Batch]:
        batches = step_batches(count)
        seen.extend({k: v.clone() for k, v in b.items()} for b in batches)
        return batches

    stream.step_batches = recording
    return seen


def test_a_registered_objective_sets_the_loss_its_gradient_and_its_normaliser(
    sequence_mean, tiny_overrides, log
):
    config = load_config(
        None,
        [*tiny_overrides, "--train.max_steps=1", "--train.loss_fn=sequence_mean",
         "--train.grad_accum_steps=2", "--train.grad_clip_norm=0"],
    )  # fmt: skip
    preflight(config)
    assert "train.loss_chunk_tokens = 2048 is not used" in log.text
    session = build_session(config, RuntimeContext())
    initial = copy.deepcopy(session.model)
    batches = _record_batches(session)
    run_training_loop(session)
    session.tracker.close()
    (row,) = train_rows(config.run_dir)

    # The same objective by hand on the initial weights: mean over every row of the step of
    # its mean token loss, backward through it.
    rows = sum(sequence_count(b) for b in batches)
    total = torch.zeros((), dtype=torch.float64)
    initial.zero_grad()
    for batch in batches:
        logits = initial(batch["input_ids"], doc_ids=batch.get("doc_ids"))
        per_token = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), batch["labels"].flatten(), reduction="none"
        ).view(batch["labels"].shape)
        loss = sequence_mean_loss(HeadLoss(per_token.sum(), per_token), batch)
        (loss / rows).backward()
        total += loss.detach().double()
    norm = torch.cat([p.grad.flatten() for p in initial.parameters() if p.grad is not None]).norm()

    assert len(batches) == 2 and row["supervised_tokens"] == rows
    # Same operations on the same weights, but the loop sums micro-batches in another order
    # and in float64 after float32 row sums: a few float32 ulps of values near ln(256) ~ 5.5.
    assert row["loss"] == pytest.approx(float(total / rows), rel=1e-5)
    # The gradient norm through the per-token weights equals the hand backward's, to float32
    # accumulation over ~1e5 parameters (rel 1e-4).
    assert row["grad_norm"] == pytest.approx(float(norm), rel=1e-4)
