"""evaluate: the eval windows come from layout-independent settings, and the forward runs
in the training step's precision."""

from __future__ import annotations

import pytest

from kempnerforge.config.loader import load_config
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.build import build_session
from kempnerforge.training.eval import eval_global_batch, evaluate


def test_the_eval_batch_is_eval_batch_size_or_the_training_global_batch():
    config = load_config(None, ["--train.batch_size=3", "--train.grad_accum_steps=2"])
    assert eval_global_batch(config.eval, config.train, 1) == 6
    assert (
        eval_global_batch(config.eval, config.train, 4) == 24
    )  # the same global batch a resume keeps
    config = load_config(None, ["--train.batch_size=3", "--eval.batch_size=10"])
    assert eval_global_batch(config.eval, config.train, 1) == 10
    assert eval_global_batch(config.eval, config.train, 8) == 10


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_eval_computes_in_the_training_steps_precision(tiny_overrides, token_dirs, precision):
    """Evaluated on the windows of the first training batch, before the step, eval reports
    the loss the step reports: the same forward in the same precision."""
    train, _ = token_dirs
    config = load_config(
        None,
        [
            *tiny_overrides,
            f"--train.mixed_precision={precision}",
            "--data.shuffle=false",
            f'--eval.sets=[{{name = "first", path = "{train}"}}]',
            "--eval.steps=1",
        ],
    )
    config.validate(1)
    session = build_session(config, RuntimeContext())
    metrics = evaluate(session.model, session.data, session.config, session.runtime)
    result = session.step_fn(session, 1)
    assert metrics["eval_tokens"] > 0
    assert metrics["eval_loss"] == pytest.approx(result.loss, abs=1e-7)
