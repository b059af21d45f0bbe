"""DeepSeek-V3 against transformers' DeepseekV3ForCausalLM: multi-head latent attention
(query latent and plain query projection, value heads narrower than the query/key heads,
interleaved RoPE channels), YaRN with DeepSeek's mscale and mscale_all_dim, and after a
dense first layer 8 sigmoid-routed experts in 2 groups (1 kept) with a non-zero balancing
bias, gates times 2.5 and a shared expert; its multi-token-prediction layer passed over."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, DEEPSEEK_V3
from kempnerforge.interop.hf import export_hf, import_hf
from kempnerforge.interop.hf_files import HFFolderError
from kempnerforge.model.attention import RopeScaling, rope_tables
from kempnerforge.model.transformer import Transformer
from tests.support import hf_families as fam

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}
"""DeepSeek's YaRN at the tiny model's scale, its two mscales apart so both show (the
published 1.0 and 1.0 leave the tables unscaled)."""
TINY: dict[str, Any] = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    moe_intermediate_size=16,
    n_shared_experts=1,
    rope_parameters=YARN,
)
"""The tiny DeepSeek-V3 in transformers' words: 4 heads whose queries and keys are 16
wide (8 without RoPE, 8 with) and values 8, latents of 16."""


def make_deepseek(folder, **keys) -> Any:
    """transformers' tiny model with its norms moved off 1 and a balancing bias of std
    0.3 (a buffer, 0 at init), saved to ``folder`` with one multi-token-prediction
    layer's tensors beside the decoder's (as published checkpoints hold them)."""
    theirs: Any = fam.make_hf_folder(
        transformers.DeepseekV3Config,
        transformers.DeepseekV3ForCausalLM,
        folder,
        **{**TINY, **keys},
    )
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, buffer in theirs.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
    theirs.save_pretrained(folder)
    path = folder / "model.safetensors"
    tensors = load_file(path)
    n_layers = theirs.config.num_hidden_layers
    mtp = {
        name.replace("model.layers.0.", f"model.layers.{n_layers}."): tensor.clone()
        for name, tensor in tensors.items()
        if name.startswith("model.layers.0.")
    }
    save_file({**tensors, **mtp}, path, metadata={"format": "pt"})
    return theirs


@pytest.fixture(scope="module", params=["q_latent", "q_proj"])
def pair(request, tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder), with the query
    latent (q_lora_rank 16) and without it (q_lora_rank null)."""
    folder = tmp_path_factory.mktemp("deepseek_v3") / "hf"
    keys = {} if request.param == "q_latent" else {"q_lora_rank": None}
    theirs = make_deepseek(folder, **keys)
    return theirs, fam.imported_model(folder), folder


def test_import_reads_latent_attention_yarn_mscales_and_grouped_routing(pair):
    theirs, ours, _ = pair
    cfg = ours.cfg
    q_rank = theirs.config.q_lora_rank or 0
    assert (cfg.mla_kv_rank, cfg.mla_q_rank) == (16, q_rank)
    assert (cfg.mla_nope_head_size, cfg.mla_rope_head_size, cfg.mla_value_head_size) == (8, 8, 8)
    assert (cfg.rope_yarn_mscale, cfg.rope_yarn_mscale_all_dim) == (0.8, 0.6)
    assert (cfg.num_experts, cfg.moe_top_k, cfg.moe_num_groups, cfg.moe_top_groups) == (8, 2, 2, 1)
    assert (cfg.moe_routed_scaling, cfg.moe_shared_experts, cfg.expert_hidden_dim) == (2.5, 1, 16)
    assert [cfg.is_moe_layer(i) for i in range(3)] == [False, True, True]
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())
    assert cfg.num_params() == sum(p.numel() for p in theirs.parameters())


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    _, ours, folder = pair
    trained = fam.perturbed(fam.imported_model(folder))
    fam.assert_export_loads_in_transformers(trained, tmp_path / "out", "DeepseekV3ForCausalLM")
    assert ours.cfg == import_hf(tmp_path / "out")[0]


def test_greedy_generation_with_the_latent_cache_equals_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def test_the_cache_holds_latents_not_keys_and_values(pair):
    from kempnerforge.model.generation.kv_cache import KVCache

    _, ours, _ = pair
    cache = KVCache.for_model(ours, 10)
    assert [tuple(k.shape) for k in cache.keys] == [(1, 1, 10, 16)] * 3
    assert [tuple(v.shape) for v in cache.values] == [(1, 1, 10, 8)] * 3


def test_yarn_tables_and_logit_scale_are_transformers(pair):
    """Our RoPE tables of the RoPE part are transformers' (attention factor m(0.8) /
    m(0.6)), and the logit multiplier is its softmax scale over 1 / sqrt(16)."""
    theirs, ours, _ = pair
    rotary = theirs.model.rotary_emb
    positions = torch.arange(64)[None]
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos, sin = rope_tables(8, 64, 10000.0, scaling=RopeScaling.of(ours.cfg))
    torch.testing.assert_close(cos, want_cos[0, :, :4], rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin[0, :, :4], rtol=0, atol=1e-6)
    scaling = theirs.model.layers[0].self_attn.scaling
    assert ours.cfg.attention_logit_multiplier == pytest.approx(scaling * 16**0.5, rel=1e-12)


def deepseek_config(**changes: Any) -> ModelConfig:
    fields: dict[str, Any] = dict(
        dim=32,
        n_layers=3,
        n_heads=4,
        num_experts=8,
        moe_top_k=2,
        moe_router="sigmoid",
        moe_shared_experts=1,
        moe_expert_hidden_dim=16,
        moe_first_dense_layers=1,
        moe_num_groups=2,
        moe_top_groups=1,
        moe_routed_scaling=2.5,
        mla_kv_rank=16,
        mla_q_rank=16,
        mla_nope_head_size=8,
        mla_rope_head_size=8,
        mla_value_head_size=8,
        max_seq_len=64,
    )
    return ModelConfig(**{**fields, **changes})


def test_export_chooses_deepseek_for_latent_attention_and_glm_without_it():
    assert ARCHITECTURES.for_config(deepseek_config()) is DEEPSEEK_V3
    standard = deepseek_config(
        mla_kv_rank=0,
        mla_q_rank=0,
        mla_nope_head_size=0,
        mla_rope_head_size=0,
        mla_value_head_size=0,
    )
    assert ARCHITECTURES.for_config(standard).model_type == "glm4_moe"


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(moe_router="softmax", moe_num_groups=1, moe_top_groups=1), "model.moe_router"),
        (dict(n_layers=4, moe_first_dense_layers=0, moe_frequency=2), "model.moe_frequency"),
        (dict(zero_centered_norms=True), "model.zero_centered_norms"),
        (dict(sliding_window=8), "model.sliding_window"),
    ],
    ids=["softmax", "interleaved", "zero-centred", "window"],
)
def test_export_refuses_what_deepseek_v3_cannot_compute(changes, field):
    with pytest.raises(ConfigError) as info:
        DEEPSEEK_V3.check_represents(deepseek_config(**changes))
    assert info.value.field == field


def test_other_classes_refuse_latent_attention_and_deepseek_routing():
    for model_type in ("gpt_oss", "glm4_moe", "qwen3_moe"):
        with pytest.raises(ConfigError) as info:
            ARCHITECTURES.named(model_type).check_represents(deepseek_config())
        assert info.value.field.startswith(("model.mla_", "model.moe_", "model.num_experts"))
    refusal = ARCHITECTURES.named("glm4_moe").matched(deepseek_config())[1]
    assert refusal is not None and refusal.field == "model.mla_kv_rank"


def _rewrite_config(folder, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(first_k_dense_replace=3), "first_k_dense_replace"),
        (dict(norm_topk_prob=False), "norm_topk_prob"),
        (dict(rope_parameters={**YARN, "attention_factor": 1.5}), "rope_parameters"),
    ],
    ids=["grouped-kv", "bias", "all-dense", "raw-gates", "attention-factor"],
)
def test_import_refuses_what_we_cannot_compute(pair, tmp_path, changes, key):
    _, _, folder = pair
    copy = tmp_path / "hf"
    copy.mkdir()
    for item in folder.iterdir():
        (copy / item.name).write_bytes(item.read_bytes())
    _rewrite_config(copy, **changes)
    with pytest.raises(HFFolderError) as info:
        import_hf(copy)
    assert f"{key} = " in str(info.value)


def test_another_class_refuses_deepseek_mscales(tmp_path):
    """A GPT-OSS folder with mscale_all_dim: its class scales the tables but not the
    logits, which our field does, so the key is refused."""
    cfg = ModelConfig(
        dim=32,
        n_layers=2,
        n_heads=4,
        num_experts=4,
        moe_top_k=2,
        attention_sinks=True,
        moe_router_bias=True,
        moe_expert_bias=True,
        moe_activation="clamped_swiglu",
        rope_scaling="yarn",
        rope_scaling_factor=4.0,
        rope_original_max_seq_len=16,
        max_seq_len=64,
    )
    folder = export_hf(Transformer(cfg), cfg, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    _rewrite_config(folder, rope_parameters={**config["rope_parameters"], "mscale_all_dim": 1.0})
    with pytest.raises(HFFolderError, match="mscale_all_dim"):
        import_hf(folder)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        (dict(mla_rope_head_size=7), "model.mla_rope_head_size"),
        (dict(mla_value_head_size=17), "model.mla_value_head_size"),
        (dict(qk_norm="per_head"), "model.qk_norm"),
        (dict(n_kv_heads=2), "model.n_kv_heads"),
        (dict(mla_kv_rank=0), "model.mla_q_rank"),
        (dict(moe_router="softmax"), "model.moe_num_groups"),
        (dict(moe_num_groups=8), "model.moe_num_groups"),
        (dict(moe_top_k=5), "model.moe_top_groups"),
        (dict(moe_first_dense_layers=3), "model.moe_first_dense_layers"),
        (dict(rope_yarn_mscale_all_dim=1.0), "model.rope_yarn_mscale_all_dim"),
    ],
    ids=[
        "odd-rope",
        "wide-values",
        "qk-norm",
        "grouped-kv",
        "sizes-without-latent",
        "groups-softmax",
        "one-expert-groups",
        "top-k-past-groups",
        "all-dense",
        "mscale-without-yarn",
    ],
)
def test_config_refuses_what_latent_attention_and_grouped_routing_cannot_be(changes, field):
    with pytest.raises(ConfigError) as info:
        deepseek_config(**changes)
    assert info.value.field == field
