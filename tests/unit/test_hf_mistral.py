"""Mistral against transformers' MistralForCausalLM: a sliding window of 5 on every layer
(the batches and the decoding run past it), and config.json's sliding_window read as
transformers reads it (absent: 4096; null: no window)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, LLAMA, MISTRAL
from kempnerforge.interop.hf import export_hf, import_hf
from kempnerforge.interop.hf_files import HFFolderError
from tests.support import hf_families as fam

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=[5, None], ids=["window", "null-window"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder)."""
    folder = tmp_path_factory.mktemp("mistral") / "hf"
    theirs = fam.make_hf_folder(
        transformers.MistralConfig,
        transformers.MistralForCausalLM,
        folder,
        sliding_window=request.param,
    )
    return theirs, fam.imported_model(folder), folder


def test_import_reads_the_window_of_every_layer(pair):
    theirs, ours, _ = pair
    window = theirs.config.sliding_window or 0
    assert [ours.cfg.layer_window(i) for i in range(2)] == [window, window]


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    _, ours, folder = pair
    trained = fam.perturbed(fam.imported_model(folder))
    if ours.cfg.sliding_window:
        fam.assert_export_loads_in_transformers(trained, tmp_path / "out", "MistralForCausalLM")
        assert import_hf(tmp_path / "out")[0] == ours.cfg
    else:
        # Without a window the model is a Llama, which export prefers; by name, a Mistral
        # with a null window.
        assert ARCHITECTURES.for_config(ours.cfg) is LLAMA
        export_hf(trained, trained.cfg, tmp_path / "out", model_type="mistral")
        assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] is None


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def test_an_absent_window_is_the_class_default(pair, tmp_path):
    _, ours, folder = pair
    config = json.loads((folder / "config.json").read_text())
    config.pop("sliding_window")
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    assert import_hf(tmp_path)[0].sliding_window == 4096


def test_export_refuses_windows_mistral_cannot_express():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, sliding_window=8)
    assert ARCHITECTURES.for_config(cfg) is MISTRAL
    with pytest.raises(ConfigError) as info:
        MISTRAL.check_represents(dataclasses.replace(cfg, sliding_window_pattern=2))
    assert info.value.field == "model.sliding_window_pattern"


def test_import_refuses_per_layer_types(pair, tmp_path):
    _, _, folder = pair
    config = json.loads((folder / "config.json").read_text())
    config["layer_types"] = ["sliding_attention", "full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    with pytest.raises(HFFolderError, match="layer_types"):
        import_hf(tmp_path)
