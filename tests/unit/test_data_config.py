"""[data] bounds: values that would fork without limit are refused at startup."""

from __future__ import annotations

import pytest

from kempnerforge.config.data import DataConfig
from kempnerforge.config.loader import load_config
from kempnerforge.core.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (257, "data.num_workers = 257: expected an integer in [0, 256]"),
        (
            10**20,
            "data.num_workers = 100000000000000000000: expected an integer in [0, 256]",
        ),
        (-1, "data.num_workers = -1: expected an integer >= 0"),
    ],
)
def test_num_workers_outside_its_bounds_is_a_config_error(value, message):
    with pytest.raises(ConfigError) as info:
        DataConfig(num_workers=value)
    assert info.value.field == "data.num_workers"
    assert str(info.value) == message


def test_num_workers_bound_applies_to_a_command_line_override():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--data.num_workers=100000"])
    assert info.value.field == "data.num_workers"
    assert str(info.value) == "data.num_workers = 100000: expected an integer in [0, 256]"


def test_num_workers_up_to_the_bound_is_accepted():
    assert DataConfig(num_workers=256).num_workers == 256
    assert DataConfig(num_workers=0).num_workers == 0
