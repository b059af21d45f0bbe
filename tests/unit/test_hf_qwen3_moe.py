"""Qwen3-MoE against transformers' Qwen3MoeForCausalLM: per-head query and key norms over
routed experts (8 of them, top-2, renormalised), with every layer MoE and a head size of
its own, and with every second layer MoE (decoder_sparse_step = 2) and the derived head
size."""

from __future__ import annotations

import dataclasses

import pytest

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, QWEN3_MOE
from kempnerforge.interop.hf import import_hf
from kempnerforge.interop.hf_files import HFFolderError
from tests.support import hf_families as fam

transformers = pytest.importorskip("transformers")

TINY_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
"""Routed experts in transformers' words: 8 experts of width 16, top-2, gates renormalised
(as every published Qwen3-MoE)."""

LAYOUTS = {
    "every-layer": dict(decoder_sparse_step=1, head_dim=16),
    "alternate": dict(decoder_sparse_step=2),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pair(request, tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder, the layout)."""
    folder = tmp_path_factory.mktemp("qwen3_moe") / "hf"
    theirs = fam.make_hf_folder(
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        folder,
        **TINY_MOE,
        **LAYOUTS[request.param],
    )
    return theirs, fam.imported_model(folder), folder, request.param


def test_import_reads_the_experts_the_layer_pattern_and_the_head_norms(pair):
    _, ours, _, layout = pair
    cfg = ours.cfg
    assert (cfg.num_experts, cfg.moe_top_k, cfg.expert_hidden_dim) == (8, 2, 16)
    assert (cfg.moe_router, cfg.moe_shared_experts, cfg.qk_norm) == ("softmax", 0, "per_head")
    sparse_step = LAYOUTS[layout]["decoder_sparse_step"]
    assert cfg.moe_frequency == sparse_step
    assert [cfg.is_moe_layer(i) for i in range(2)] == [sparse_step == 1, True]
    assert cfg.head_dim == LAYOUTS[layout].get("head_dim", 8)
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    _, ours, folder, _ = pair
    trained = fam.perturbed(fam.imported_model(folder))
    fam.assert_export_loads_in_transformers(trained, tmp_path / "out", "Qwen3MoeForCausalLM")
    assert ours.cfg == import_hf(tmp_path / "out")[0]


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    theirs, ours, _, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def test_export_picks_qwen3_moe_for_per_head_norms_and_refuses_what_it_lacks():
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=4, qk_norm="per_head", num_experts=8, moe_top_k=2)
    assert ARCHITECTURES.for_config(cfg) is QWEN3_MOE
    # Without the head norms the same MoE is a Mixtral.
    assert ARCHITECTURES.for_config(dataclasses.replace(cfg, qk_norm="none")) is not QWEN3_MOE
    with pytest.raises(ConfigError) as info:
        QWEN3_MOE.check_represents(dataclasses.replace(cfg, moe_shared_experts=1))
    assert info.value.field == "model.moe_shared_experts"
    with pytest.raises(ConfigError) as info:
        QWEN3_MOE.check_represents(dataclasses.replace(cfg, moe_router="sigmoid"))
    assert info.value.field == "model.moe_router"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (dict(mlp_only_layers=[0]), "mlp_only_layers = \\[0\\]: expected \\[\\]"),
        (dict(norm_topk_prob=False), "norm_topk_prob = False: expected True"),
    ],
)
def test_import_refuses_what_our_moe_does_not_compute_naming_the_key(tmp_path, keys, message):
    fam.make_hf_folder(
        transformers.Qwen3MoeConfig,
        transformers.Qwen3MoeForCausalLM,
        tmp_path,
        **{**TINY_MOE, **keys},
    )
    with pytest.raises(HFFolderError, match=message):
        import_hf(tmp_path)
