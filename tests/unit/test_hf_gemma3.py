"""Gemma 3 against transformers' Gemma3ForCausalLM: four zero-centred norms per block,
per-head query and key norms, GeGLU, embeddings times sqrt(width), sliding layers with their
own RoPE base beside global ones, in two shapes: the 1B's (tied, unscaled RoPE, the logits
scaled by the head size) and the 4B-and-up's (linear RoPE scaling on the global layers, a
query_pre_attn_scalar apart from the head size), here untied."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, GEMMA3
from kempnerforge.interop.hf import import_hf
from kempnerforge.interop.hf_files import HFFolderError
from tests.support import hf_families as fam

transformers = pytest.importorskip("transformers")

SHAPES = {
    # Gemma 3 1B: tied, plain RoPE on both kinds, logits scaled by the head size.
    "1b": dict(tie_word_embeddings=True, query_pre_attn_scalar=16),
    # Gemma 3 4B to 27B: global layers' RoPE interpolated 8x, a scalar of its own (27B's
    # 168 against heads of 128).
    "4b": dict(
        tie_word_embeddings=False,
        query_pre_attn_scalar=12,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
}
WINDOWED = dict(head_dim=16, num_hidden_layers=3, sliding_window=6, sliding_window_pattern=3)
"""Two sliding layers (a window of 6 of the test's 24 positions) and one global."""


def make_gemma3(folder, **keys):
    return fam.make_hf_folder(
        transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM, folder, **keys
    )


@pytest.fixture(scope="module", params=list(SHAPES))
def pair(request, tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder)."""
    folder = tmp_path_factory.mktemp("gemma3") / "hf"
    theirs = make_gemma3(folder, **WINDOWED, **SHAPES[request.param])
    return theirs, fam.imported_model(folder), folder


def test_import_reads_every_gemma_option(pair):
    theirs, ours, _ = pair
    cfg, hf = ours.cfg, theirs.config
    assert (cfg.norm_placement, cfg.qk_norm, cfg.ffn_activation) == (
        "sandwich",
        "per_head",
        "gelu_tanh",
    )
    assert cfg.zero_centered_norms and cfg.embedding_multiplier == math.sqrt(32)
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1e6, 1e4)
    assert (cfg.attention_scale_size or cfg.head_dim) == hf.query_pre_attn_scalar
    assert cfg.tie_embeddings == hf.tie_word_embeddings
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    _, ours, _ = pair
    trained = fam.perturbed(fam.imported_model(pair[2]))
    fam.assert_export_loads_in_transformers(trained, tmp_path / "out", "Gemma3ForCausalLM")
    assert ours.cfg == import_hf(tmp_path / "out")[0]


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def test_the_published_checkpoints_config_dialect_reads_the_same(pair, tmp_path):
    """The published config.json files (transformers 4) carry rope_theta,
    rope_local_base_freq, rope_scaling and sliding_window_pattern, not rope_parameters
    and layer_types: the same model either way."""
    _, ours, folder = pair
    data = json.loads((folder / "config.json").read_text())
    rope = data.pop("rope_parameters")
    del data["layer_types"]
    full = rope["full_attention"]
    data.update(
        rope_theta=full["rope_theta"],
        rope_local_base_freq=rope["sliding_attention"]["rope_theta"],
        rope_scaling={"rope_type": "linear", "factor": full["factor"]}
        if full["rope_type"] == "linear"
        else None,
        sliding_window_pattern=3,
    )
    (tmp_path / "config.json").write_text(json.dumps(data))
    for name in folder.iterdir():
        if name.name != "config.json":
            (tmp_path / name.name).symlink_to(name)
    assert import_hf(tmp_path)[0] == ours.cfg


def test_embeddings_are_scaled_by_the_multiplier_rounded_to_bf16():
    """sqrt(3072) = 55.43 multiplies bf16 embeddings as 55.5, as Gemma's reference does."""
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=4, embedding_multiplier=math.sqrt(3072))
    model = fam.Transformer(cfg)
    ids = torch.tensor([[1, 2, 3]])
    assert model.tok_embeddings is not None
    table = model.tok_embeddings.weight
    assert torch.equal(model.embed(ids), table[ids] * math.sqrt(3072))
    model.to(torch.bfloat16)
    assert torch.equal(model.embed(ids), table[ids].to(torch.bfloat16) * 55.5)


def test_export_picks_gemma3_and_refuses_what_it_lacks():
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        head_size=16,
        qk_norm="per_head",
        norm_placement="sandwich",
        zero_centered_norms=True,
        ffn_activation="gelu_tanh",
        embedding_multiplier=math.sqrt(32),
        sliding_window=4,
        sliding_window_pattern=2,
        rope_local_theta=1e4,
        rope_scaling="linear",
        rope_scaling_factor=8.0,
    )
    assert ARCHITECTURES.for_config(cfg) is GEMMA3
    for change, field in (
        (dict(zero_centered_norms=False), "model.zero_centered_norms"),
        (dict(ffn_activation="silu"), "model.ffn_activation"),
        (dict(embedding_multiplier=2.0), "model.embedding_multiplier"),
        (dict(norm_placement="pre"), "model.norm_placement"),
        (dict(rope_local_theta=0.0), "model.rope_local_theta"),
    ):
        with pytest.raises(ConfigError) as info:
            GEMMA3.check_represents(dataclasses.replace(cfg, **change))
        assert info.value.field == field
    # No other class takes Gemma's options: the closest, Gemma 3, names what it lacks.
    with pytest.raises(ConfigError, match="model.norm_placement = 'pre'.*Gemma3ForCausalLM"):
        ARCHITECTURES.for_config(dataclasses.replace(cfg, norm_placement="pre", qk_norm="none"))


@pytest.mark.parametrize(
    "keys, message",
    [
        (dict(final_logit_softcapping=30.0), "final_logit_softcapping = 30.0: expected None"),
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping = 50.0: expected None"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention = True"),
    ],
)
def test_import_refuses_gemma2_options_naming_the_key(tmp_path, keys, message):
    make_gemma3(tmp_path, head_dim=8, **keys)
    with pytest.raises(HFFolderError, match=message):
        import_hf(tmp_path)


def test_config_rules_name_the_field():
    with pytest.raises(ConfigError, match="model.ffn_activation = 'gelu'.*gelu_tanh"):
        ModelConfig(ffn_activation="gelu")
    with pytest.raises(ConfigError, match="model.ffn_activation.*'silu' for an MoE model"):
        ModelConfig(num_experts=4, ffn_activation="gelu_tanh")
    with pytest.raises(ConfigError, match="model.rope_scaling_factor = 8.0.*rope_scaling"):
        ModelConfig(rope_scaling_factor=8.0)
    with pytest.raises(ConfigError, match="model.rope_local_theta.*0 when no layer slides"):
        ModelConfig(rope_local_theta=1e4)
    with pytest.raises(ConfigError, match="model.embedding_multiplier"):
        ModelConfig(embedding_multiplier=0.0)
