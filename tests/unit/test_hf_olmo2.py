"""OLMo 2 against transformers' Olmo2ForCausalLM: norms on the sublayers' outputs and query
and key norms over the whole projections (4 query heads, 2 key/value heads)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, OLMO2
from kempnerforge.interop.hf import import_hf
from kempnerforge.interop.hf_files import HFFolderError
from tests.support import hf_families as fam

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder)."""
    folder = tmp_path_factory.mktemp("olmo2") / "hf"
    theirs = fam.make_hf_folder(transformers.Olmo2Config, transformers.Olmo2ForCausalLM, folder)
    return theirs, fam.imported_model(folder), folder


def test_import_reads_post_norms_and_whole_projection_norms(pair):
    _, ours, _ = pair
    assert (ours.cfg.norm_placement, ours.cfg.qk_norm) == ("post", "projection")
    block = ours.layers["0"]
    assert block.attention_norm is None and block.ffn_norm is None
    assert block.attention.q_norm.weight.shape == (32,)  # 4 heads of 8
    assert block.attention.k_norm.weight.shape == (16,)  # 2 key/value heads of 8
    assert ours.cfg.num_params() == sum(p.numel() for p in ours.parameters())


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    _, ours, folder = pair
    trained = fam.perturbed(fam.imported_model(folder))
    fam.assert_export_loads_in_transformers(trained, tmp_path / "out", "Olmo2ForCausalLM")
    assert import_hf(tmp_path / "out")[0] == ours.cfg


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def test_export_picks_olmo2_and_refuses_half_of_it():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, qk_norm="projection", norm_placement="post")
    assert ARCHITECTURES.for_config(cfg) is OLMO2
    with pytest.raises(ConfigError) as info:
        OLMO2.check_represents(dataclasses.replace(cfg, qk_norm="per_head"))
    assert info.value.field == "model.qk_norm"
    with pytest.raises(ConfigError) as info:
        ARCHITECTURES.for_config(dataclasses.replace(cfg, qk_norm="none"))
    assert info.value.field == "model.qk_norm"


def test_import_refuses_a_head_size_apart_from_the_width(pair, tmp_path):
    _, _, folder = pair
    config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(HFFolderError, match="head_dim = 16: expected hidden_size"):
        import_hf(tmp_path)


def test_norm_placement_rule_names_the_field():
    with pytest.raises(ConfigError, match="model.norm_placement = 'after'"):
        ModelConfig(norm_placement="after")
