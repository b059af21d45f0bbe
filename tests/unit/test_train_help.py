"""`kempnerforge train --help` lists every config section, read from JobConfig itself."""

from __future__ import annotations

import dataclasses

import pytest

from kempnerforge.cli import main
from kempnerforge.config.job import JobConfig


def train_help(capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog


def test_train_help_names_every_config_section_the_optional_ones_last(capsys):
    text = train_help(capsys)
    names = [f.name for f in dataclasses.fields(JobConfig)]
    assert {"vision_encoder", "adapter", "vlm"} <= set(names)
    for name in names:
        assert f"[{name}]" in text
    assert "and the optional [vision_encoder], [adapter], [vlm]." in text


def test_train_help_quotes_its_list_override_for_the_shell(capsys):
    assert "--optimizer.betas='[0.9,0.95]'" in train_help(capsys)
