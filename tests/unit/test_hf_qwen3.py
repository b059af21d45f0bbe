"""Qwen3 against transformers' Qwen3ForCausalLM: per-head query and key norms and a head
size apart from the width (16 for a width of 32 over 4 heads), tied and untied."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, QWEN3
from kempnerforge.interop.hf import import_hf
from kempnerforge.interop.hf_files import HFFolderError
from tests.support import hf_families as fam

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder)."""
    folder = tmp_path_factory.mktemp("qwen3") / "hf"
    theirs = fam.make_hf_folder(
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        folder,
        head_dim=16,
        tie_word_embeddings=request.param,
    )
    return theirs, fam.imported_model(folder), folder


def test_import_reads_the_head_size_and_the_per_head_norms(pair):
    _, ours, _ = pair
    assert (ours.cfg.head_size, ours.cfg.head_dim, ours.cfg.qk_norm) == (16, 16, "per_head")
    assert ours.layers["0"].attention.q_norm.weight.shape == (16,)
    assert ours.cfg.num_params() == sum(p.numel() for p in ours.parameters())


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    _, ours, _ = pair
    trained = fam.perturbed(fam.imported_model(pair[2]))
    fam.assert_export_loads_in_transformers(trained, tmp_path / "out", "Qwen3ForCausalLM")
    assert ours.cfg == import_hf(tmp_path / "out")[0]


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def test_export_picks_qwen3_for_per_head_norms_and_refuses_what_it_lacks():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, head_size=16, qk_norm="per_head")
    assert ARCHITECTURES.for_config(cfg) is QWEN3
    with pytest.raises(ConfigError) as info:
        QWEN3.check_represents(dataclasses.replace(cfg, norm_placement="post"))
    assert info.value.field == "model.norm_placement"
    with pytest.raises(ConfigError) as info:
        QWEN3.check_represents(dataclasses.replace(cfg, qk_norm="none"))
    assert info.value.field == "model.qk_norm"


def test_import_refuses_a_sliding_window_naming_the_key(tmp_path):
    fam.make_hf_folder(
        transformers.Qwen3Config,
        transformers.Qwen3ForCausalLM,
        tmp_path,
        head_dim=8,
        use_sliding_window=True,
        sliding_window=4,
    )
    with pytest.raises(HFFolderError, match="use_sliding_window = True: expected False"):
        import_hf(tmp_path)


def test_config_rules_name_the_field():
    with pytest.raises(ConfigError, match="model.qk_norm = 'perhead'.*did you mean 'per_head'"):
        ModelConfig(qk_norm="perhead")
    with pytest.raises(ConfigError, match="model.head_size = 7: expected an even size"):
        ModelConfig(head_size=7)
    # A head size of its own frees n_heads from dividing the width.
    cfg = ModelConfig(dim=48, n_heads=5, head_size=16)
    assert cfg.head_dim == 16
    assert fam.Transformer(cfg).layers["0"].attention.wq.weight.shape == torch.Size([80, 48])
