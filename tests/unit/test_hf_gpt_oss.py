"""GPT-OSS against transformers' GptOssForCausalLM: attention with biases and a learned
sink per head, a sliding layer (window 8 of the 24 positions) then a full one, YaRN RoPE,
a head size of its own, and in every layer 4 experts (top-2) with a biased router, biased
experts and the clamped SwiGLU (its clamp low enough to bind); and YaRN's tables against
transformers' own."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import ARCHITECTURES, GPT_OSS
from kempnerforge.interop.hf import import_hf
from kempnerforge.interop.hf_files import HFFolderError
from kempnerforge.model.attention import RopeScaling, rope_tables, yarn_frequencies
from tests.support import hf_families as fam
from tests.support.tolerance import assert_reordered_close

transformers = pytest.importorskip("transformers")

YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
}
"""GPT-OSS's RoPE at the tiny model's scale: 4 times an original 16 positions."""
TINY = dict(
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=0.4,
    rope_parameters=YARN,
)
"""The tiny GPT-OSS in transformers' words; layer_types is the class's alternation
(sliding, full). A clamp of 0.4 binds at this init's expert activations (about 0.6)."""
MOVED = {"norm": 0.3, "bias": 0.3, "sinks": 1.5}
"""The biases (0 at init) moved like the norms, the sinks near a row's log-sum-exp (a few
units at 24 positions) so the sink's share of each softmax is far from 0."""


def make_gpt_oss(folder, **keys):
    return fam.make_hf_folder(
        transformers.GptOssConfig,
        transformers.GptOssForCausalLM,
        folder,
        moved=MOVED,
        **{**TINY, **keys},
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(transformers' model, ours imported from its folder, the folder)."""
    folder = tmp_path_factory.mktemp("gpt_oss") / "hf"
    theirs = make_gpt_oss(folder)
    return theirs, fam.imported_model(folder), folder


def test_import_reads_sinks_biases_windows_yarn_and_the_clamped_experts(pair):
    _, ours, _ = pair
    cfg = ours.cfg
    assert (cfg.attention_sinks, cfg.attention_bias) == (True, True)
    assert (cfg.moe_router_bias, cfg.moe_expert_bias) == (True, True)
    assert (cfg.moe_activation, cfg.moe_swiglu_limit, cfg.moe_swiglu_alpha) == (
        "clamped_swiglu",
        0.4,
        1.702,
    )
    assert (cfg.num_experts, cfg.moe_top_k, cfg.expert_hidden_dim, cfg.head_dim) == (4, 2, 48, 16)
    assert [cfg.layer_window(i) for i in range(2)] == [8, 0]
    assert (cfg.rope_scaling, cfg.rope_scaling_factor, cfg.rope_original_max_seq_len) == (
        "yarn",
        4.0,
        16,
    )
    assert cfg.rope_yarn_truncate is False
    assert cfg.num_params() == sum(p.numel() for p in ours.parameters())


def test_imported_logits_equal_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)


def test_export_of_trained_weights_loads_in_transformers(pair, tmp_path):
    _, ours, folder = pair
    trained = fam.perturbed(fam.imported_model(folder))
    fam.assert_export_loads_in_transformers(trained, tmp_path / "out", "GptOssForCausalLM")
    assert ours.cfg == import_hf(tmp_path / "out")[0]


def test_greedy_generation_with_the_cache_equals_transformers(pair):
    theirs, ours, _ = pair
    fam.assert_greedy_generation_equal(ours, theirs)


def gpt_oss_config(**changes) -> ModelConfig:
    fields = dict(
        dim=32,
        n_layers=2,
        n_heads=4,
        num_experts=4,
        moe_top_k=2,
        attention_sinks=True,
        attention_bias=True,
        moe_router_bias=True,
        moe_expert_bias=True,
        moe_activation="clamped_swiglu",
    )
    return ModelConfig(**{**fields, **changes})


def test_export_picks_gpt_oss_and_refuses_what_it_lacks_naming_the_field():
    cfg = gpt_oss_config()
    assert ARCHITECTURES.for_config(cfg) is GPT_OSS
    refusals = {
        "moe_top_k": dict(moe_top_k=1),
        "moe_shared_experts": dict(moe_shared_experts=1),
        "moe_expert_bias": dict(moe_expert_bias=False),
        "moe_router_bias": dict(moe_router_bias=False),
        "moe_activation": dict(moe_activation="swiglu"),
        "attention_sinks": dict(attention_sinks=False),
        "qk_norm": dict(qk_norm="per_head"),
        "moe_frequency": dict(moe_frequency=2),
    }
    for field, changes in refusals.items():
        with pytest.raises(ConfigError) as info:
            GPT_OSS.check_represents(dataclasses.replace(cfg, **changes))
        assert info.value.field == f"model.{field}"


@pytest.mark.parametrize(
    "field",
    ["attention_sinks", "attention_bias", "rope_scaling"],
)
def test_other_architectures_refuse_what_only_gpt_oss_computes(field):
    """A dense model with sinks, biases or YaRN is no Llama, Mistral, Qwen3 or OLMo 2:
    export names the field instead of dropping it."""
    value = {"rope_scaling": "yarn"}.get(field, True)
    fields: dict[str, Any] = dict(dim=32, n_layers=2, n_heads=4)
    fields[field] = value
    if value == "yarn":
        fields.update(rope_scaling_factor=4.0, rope_original_max_seq_len=16)
    cfg = ModelConfig(**fields)
    with pytest.raises(ConfigError) as info:
        ARCHITECTURES.for_config(cfg)
    assert info.value.field == f"model.{field}"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (dict(num_experts_per_tok=1), "num_experts_per_tok = 1: expected >= 2"),
        (
            dict(rope_parameters={**YARN, "mscale": 0.7, "mscale_all_dim": 0.7}),
            "mscale = 0.7 is not supported",
        ),
        (dict(rope_parameters={**YARN, "rope_type": "longrope"}), "RoPE type 'longrope'"),
    ],
)
def test_import_refuses_what_our_model_does_not_compute_naming_the_key(tmp_path, keys, message):
    make_gpt_oss(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **keys}))
    with pytest.raises(HFFolderError, match=message):
        import_hf(tmp_path)


@pytest.mark.parametrize(
    "case",
    [
        dict(head_dim=16, theta=150000.0, factor=4.0, original=16, truncate=False),
        dict(head_dim=64, theta=150000.0, factor=32.0, original=4096, truncate=False),
        dict(head_dim=128, theta=10000.0, factor=40.0, original=4096, truncate=True),
    ],
    ids=["tiny", "gpt-oss", "deepseek-v3-like"],
)
def test_yarn_tables_equal_transformers_rope_init(case):
    """inv_freq and the attention factor equal transformers' yarn init function, and the
    cos/sin tables its rotary embedding's (both times the factor), on the tiny model,
    the published GPT-OSS and DeepSeek-V3's truncated ramp."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "yarn",
        "rope_theta": case["theta"],
        "factor": case["factor"],
        "original_max_position_embeddings": case["original"],
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": case["truncate"],
    }
    hf = transformers.GptOssConfig(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=case["head_dim"],
        max_position_embeddings=case["original"] * 4,
        rope_parameters=params,
    )
    want_freq, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, torch.device("cpu"))
    scaling = RopeScaling(
        "yarn", case["factor"], case["original"], 32.0, 1.0, truncate=case["truncate"]
    )
    base = 1.0 / case["theta"] ** (torch.arange(0, case["head_dim"], 2) / case["head_dim"])
    got_freq, got_factor = yarn_frequencies(base, case["head_dim"], case["theta"], scaling)
    assert got_factor == pytest.approx(want_factor, rel=1e-12)
    # Their interpolated frequency is 1 / (factor * theta**x), ours (1 / theta**x) / factor:
    # one rounding apart, plus the blend's two products and sum.
    assert_reordered_close(got_freq, want_freq, terms=3, dtype=torch.float32)
    seq = 64
    cos, sin = rope_tables(case["head_dim"], seq, case["theta"], scaling=scaling)
    rotary = transformers.models.gpt_oss.modeling_gpt_oss.GptOssRotaryEmbedding(hf)
    x = torch.zeros(1, seq, 1)
    want_cos, want_sin = rotary(x, torch.arange(seq)[None])
    # Angles up to 64 radians computed from frequencies a rounding apart: the angle's
    # error is position * |d freq|, under 64 * 3 u of the largest frequency (1).
    for got, want in ((cos, want_cos[0]), (sin, want_sin[0])):
        assert_reordered_close(got, want, terms=3 * seq, magnitude=got_factor, dtype=torch.float32)


MXFP4_QUANTIZATION = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
"""config.json's quantization_config in the published GPT-OSS folders."""


@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    """A GPT-OSS folder as published: each expert projection in MXFP4 blocks and scales
    (random bytes; scales of 2**-6 to 2**-3, the size of trained experts' weights), every
    other tensor and config.json as transformers saves them (experts 64 wide: MXFP4 blocks
    cover 32 inputs)."""
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    make_gpt_oss(root / "float", intermediate_size=64)
    generator = torch.Generator().manual_seed(5)
    tensors = {}
    for name, value in load_file(root / "float" / "model.safetensors").items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = value
            continue
        experts, inputs, outputs = value.shape  # (experts, in, out), the float layout
        shape = (experts, outputs, inputs // 32)
        tensors[f"{name}_blocks"] = torch.randint(
            0, 256, (*shape, 16), generator=generator, dtype=torch.uint8
        )
        tensors[f"{name}_scales"] = torch.randint(
            121, 125, shape, generator=generator, dtype=torch.uint8
        )
    folder = root / "mxfp4"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((root / "float" / "config.json").read_text())
    config["quantization_config"] = MXFP4_QUANTIZATION
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_mxfp4_experts_dequantize_as_transformers_does(mxfp4_folder):
    from safetensors.torch import load_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kempnerforge.interop.mxfp4 import dequantize_folder_tensors

    packed = load_file(mxfp4_folder / "model.safetensors")
    ours = dequantize_folder_tensors(packed)
    checked = 0
    for name in [n for n in packed if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        want = convert_moe_packed_tensors(
            packed[name], packed[f"{base}_scales"], dtype=torch.float32
        )
        assert torch.equal(ours[base], want), base
        assert f"{base}_scales" not in ours and name not in ours
        checked += 1
    assert checked == 4  # gate_up and down of each of the 2 layers


def test_a_published_mxfp4_folder_imports_to_transformers_logits(mxfp4_folder):
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        mxfp4_folder,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32,
    ).eval()
    ours = fam.imported_model(mxfp4_folder)
    fam.assert_unpacked_logits_equal(ours, theirs)
    fam.assert_packed_logits_equal(ours, theirs)
