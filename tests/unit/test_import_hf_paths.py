"""The lines `kempnerforge import-hf` prints work as printed, from where it was run."""

from __future__ import annotations

import re

from kempnerforge.cli import main
from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.hf import export_hf
from kempnerforge.model.transformer import Transformer


def test_printed_include_works_from_a_config_in_another_folder(tmp_path, monkeypatch, capsys):
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, vocab_size=259, max_seq_len=64)
    model = Transformer(cfg)
    model.init_weights(0)
    export_hf(model, cfg, tmp_path / "hf", model_type="llama")
    monkeypatch.chdir(tmp_path)
    assert main(["import-hf", "--model", "hf", "--out", "imported/tiny"]) == 0
    include = re.search(r"include = \[.*?\]", capsys.readouterr().out)
    assert include is not None
    # Includes resolve against the including file: a config kept in its own folder must
    # still find the model table through the printed line.
    job = tmp_path / "configs" / "job.toml"
    job.parent.mkdir()
    job.write_text(include.group(0) + "\n")
    assert load_config(str(job)).model.dim == 32
