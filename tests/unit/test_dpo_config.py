"""[dpo] and train.loss_fn = "dpo" are checked at startup: each wrong setting is refused with
the field, the value, what is allowed and what to do."""

from __future__ import annotations

import pytest

from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.runtime import RuntimeContext
from kempnerforge.training.build import build_session

DPO = "--train.loss_fn=dpo"


@pytest.mark.parametrize(
    ("overrides", "field", "says"),
    [
        (["--dpo.beta=0"], "dpo.beta", "> 0"),
        (["--dpo.loss_type=sigmod"], "dpo.loss_type", "did you mean 'sigmoid'"),
        (["--dpo.label_smoothing=0.5"], "dpo.label_smoothing", "[0.0, 0.4999]"),
        (["--dpo.loss_type=ipo", "--dpo.label_smoothing=0.1"], "dpo.label_smoothing",
         "sigmoid (cDPO), simpo and robust"),
        ([DPO, "--train.batch_size=3"], "train.batch_size", "chosen rows first"),
        ([DPO, "--train.z_loss_weight=0.001"], "train.z_loss_weight", "log-probabilities"),
        ([DPO, "--distributed.pp=2", "--train.grad_accum_steps=2"], "distributed.pp",
         "pipeline step"),
        ([DPO, "--distributed.cp=2"], "distributed.cp", "one rank"),
    ],
)  # fmt: skip
def test_a_wrong_dpo_setting_is_refused_at_startup(tiny_overrides, overrides, field, says):
    with pytest.raises(ConfigError) as raised:
        load_config(None, [*tiny_overrides, *overrides]).validate(world_size=2)
    message = str(raised.value)
    assert field in message and says in message, message


def test_dpo_refuses_training_data_that_is_not_preference_pairs(tiny_overrides):
    config = load_config(None, [*tiny_overrides, DPO, "--train.batch_size=2"])
    with pytest.raises(ConfigError) as raised:
        build_session(config, RuntimeContext())
    assert "data.path" in str(raised.value) and "--format preference" in str(raised.value)
