"""Hugging Face export and import: logits equal transformers' own classes, bit-exact round
trips, and every refusal naming its field, file or tensor. Tiny models, nothing downloaded."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.hf import export_hf, hf_architecture, import_hf, load_hf_into
from kempnerforge.interop.hf_files import HFFolderError
from kempnerforge.model.moe.layer import Router
from kempnerforge.model.transformer import Transformer
from tests.support.tolerance import reorder_atol, transformer_terms

transformers = pytest.importorskip("transformers")

# transformers builds the zero-width shared experts of an exported Qwen2-MoE / GLM-4-MoE
# model (see interop/architectures) and warns that it has nothing to initialise in them.
pytestmark = pytest.mark.filterwarnings("ignore:Initializing zero-element tensors:UserWarning")


def logits_atol(cfg: ModelConfig, logits: torch.Tensor) -> float:
    """Largest |our logit - transformers' logit| accepted: the two implementations sum in
    different orders, so fp32 reordering over the forward's chain of sums (random_ids'
    24 positions) at the logits' scale."""
    terms = transformer_terms(cfg, 24, backward=False)
    return reorder_atol(torch.float32, terms, logits.abs().max().item())


TINY: dict[str, Any] = dict(
    dim=32, n_layers=2, n_heads=4, vocab_size=259, max_seq_len=64, multiple_of=16
)


HF_TINY: dict[str, Any] = dict(
    vocab_size=259,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)
"""The models transformers makes here, in its config's words: TINY's size with 2 key/value
heads, initialized as widely as tiny_cfg (far from 0, so a wrong mapping shows)."""


def tiny_cfg(**fields) -> ModelConfig:
    # A larger init than training's 0.02, so the logits are far from 0 and a wrong mapping
    # (a swapped norm, a missing bias) shows far above the tolerance.
    return ModelConfig(**{**TINY, "init_std": 0.1, **fields})


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """A model with random weights everywhere: norms and router biases too (their inits
    are constants, which would hide a mix-up between them)."""
    model = Transformer(cfg)
    model.init_weights(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
        for module in model.modules():
            if isinstance(module, Router) and module.expert_bias is not None:
                module.expert_bias.copy_(0.2 * torch.randn(cfg.num_experts, generator=generator))
    return model.eval()


def random_ids(cfg: ModelConfig, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))


def hf_model(folder: Path) -> nn.Module:
    """The folder loaded by the transformers class its config.json names, in fp32, with
    every tensor used and none missing, but the multi-token-prediction layers after the
    decoder's (num_nextn_predict_layers), which the class does not build."""
    config = json.loads((folder / "config.json").read_text())
    cls = getattr(transformers, config["architectures"][0])
    model, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    layers, extra = config["num_hidden_layers"], config.get("num_nextn_predict_layers", 0)
    mtp = tuple(f"model.layers.{layers + k}." for k in range(extra))
    unexpected = {key for key in info["unexpected_keys"] if not (mtp and key.startswith(mtp))}
    assert bool(mtp) == (unexpected != set(info["unexpected_keys"]))
    for key, left in (("missing", info["missing_keys"]), ("unexpected", unexpected)):
        assert not left, (key, left)
    assert not info["mismatched_keys"], info["mismatched_keys"]
    return model.eval()


def our_logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    assert isinstance(out, torch.Tensor)
    return out


def assert_logits_match(model: Transformer, folder: Path, seed: int = 0) -> nn.Module:
    ids = random_ids(model.cfg, seed)
    ours = our_logits(model, ids)
    hf = hf_model(folder)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert ours.abs().max() > 0.5, "logits too small for the tolerance to mean anything"
    assert (ours - theirs).abs().max().item() < logits_atol(model.cfg, theirs)
    return hf


def assert_state_dicts_bitwise_equal(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), f"{name} differs"


# --- Dense: LlamaForCausalLM ------------------------------------------------------------------

DENSE = {
    "untied": tiny_cfg(),
    "tied": tiny_cfg(tie_embeddings=True),
    "gqa": tiny_cfg(n_kv_heads=2, rope_theta=500000.0, norm_eps=1e-6),
    "gqa-tied-mqa": tiny_cfg(n_kv_heads=1, tie_embeddings=True, ffn_hidden_dim=40),
}


@pytest.mark.parametrize("name", list(DENSE))
def test_llama_export_gives_transformers_our_logits(tmp_path, name):
    cfg = DENSE[name]
    model = random_model(cfg)
    folder = export_hf(model, cfg, tmp_path / "hf", tokenizer_path="byte", model_type="llama")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["intermediate_size"] == cfg.hidden_dim
    assert config["num_key_value_heads"] == cfg.kv_heads
    assert (config["bos_token_id"], config["eos_token_id"]) == (256, 257)
    assert ("lm_head.weight" in load_file(folder / "model.safetensors")) != cfg.tie_embeddings
    assert_logits_match(model, folder)


@pytest.mark.parametrize("name", list(DENSE))
def test_llama_round_trip_is_bitwise(tmp_path, name):
    cfg = DENSE[name]
    model = random_model(cfg)
    export_hf(model, cfg, tmp_path / "hf", model_type="llama")
    found, state = import_hf(tmp_path / "hf", model_type="llama")
    assert_state_dicts_bitwise_equal(state, model.state_dict())
    assert (found.dim, found.kv_heads, found.hidden_dim) == (cfg.dim, cfg.kv_heads, cfg.hidden_dim)
    assert (found.rope_theta, found.norm_eps) == (cfg.rope_theta, cfg.norm_eps)
    assert found.tie_embeddings == cfg.tie_embeddings


def test_load_llama_into_a_fresh_model_reproduces_it(tmp_path):
    cfg = DENSE["gqa"]
    model = random_model(cfg, seed=3)
    export_hf(model, cfg, tmp_path / "hf", model_type="llama")
    fresh = random_model(cfg, seed=4)
    load_hf_into(fresh, tmp_path / "hf", model_type="llama")
    assert_state_dicts_bitwise_equal(fresh.state_dict(), model.state_dict())
    ids = random_ids(cfg)
    assert torch.equal(our_logits(fresh, ids), our_logits(model, ids))


def test_a_model_exported_by_transformers_loads_into_ours(tmp_path):
    """The other direction: a LlamaForCausalLM made and saved by transformers itself."""
    hf_cfg = transformers.LlamaConfig(**HF_TINY, intermediate_size=48, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    found, state = import_hf(tmp_path / "hf")
    model = Transformer(found)
    load_hf_into(model, tmp_path / "hf")
    ids = random_ids(found)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (our_logits(model.eval(), ids) - theirs).abs().max().item() < logits_atol(found, theirs)


def test_load_into_refuses_a_model_of_another_config(tmp_path):
    cfg = DENSE["untied"]
    export_hf(random_model(cfg), cfg, tmp_path / "hf", model_type="llama")
    other = Transformer(dataclasses.replace(cfg, rope_theta=20000.0))
    with pytest.raises(ConfigError) as info:
        load_hf_into(other, tmp_path / "hf", model_type="llama")
    assert info.value.field == "model.rope_theta"
    assert "10000.0" in str(info.value)


# --- MoE --------------------------------------------------------------------------------------

MOE = {
    "softmax-top2-mixtral": (
        tiny_cfg(num_experts=4, moe_top_k=2, moe_expert_hidden_dim=16),
        "MixtralForCausalLM",
    ),
    "softmax-top1-qwen2moe": (
        tiny_cfg(num_experts=4, moe_top_k=1, moe_expert_hidden_dim=16),
        "Qwen2MoeForCausalLM",
    ),
    "softmax-every-2nd-qwen2moe": (
        tiny_cfg(n_layers=4, num_experts=4, moe_top_k=2, moe_frequency=2, n_kv_heads=2),
        "Qwen2MoeForCausalLM",
    ),
    "sigmoid-top2-shared-glm4moe": (
        tiny_cfg(
            num_experts=6,
            moe_top_k=2,
            moe_router="sigmoid",
            moe_shared_experts=2,
            moe_expert_hidden_dim=16,
            tie_embeddings=True,
        ),
        "Glm4MoeForCausalLM",
    ),
    "sigmoid-top1-last-layer-glm4moe": (
        tiny_cfg(
            n_layers=3,
            num_experts=4,
            moe_top_k=1,
            moe_router="sigmoid",
            moe_frequency=3,
            moe_expert_hidden_dim=16,
        ),
        "Glm4MoeForCausalLM",
    ),
    # A multi-token-prediction layer after the decoder's (model.layers.<n_layers>), which
    # transformers passes over: with the last layer alone MoE, the MTP layer is MoE too.
    "sigmoid-top2-shared-glm4moe-mtp": (
        tiny_cfg(
            num_experts=6,
            moe_top_k=2,
            moe_router="sigmoid",
            moe_shared_experts=2,
            moe_expert_hidden_dim=16,
            tie_embeddings=True,
            mtp_depth=2,
        ),
        "Glm4MoeForCausalLM",
    ),
    "sigmoid-top1-last-layer-glm4moe-mtp": (
        tiny_cfg(
            n_layers=3,
            num_experts=4,
            moe_top_k=1,
            moe_router="sigmoid",
            moe_frequency=3,
            moe_expert_hidden_dim=16,
            mtp_depth=1,
        ),
        "Glm4MoeForCausalLM",
    ),
}


def test_a_class_without_mtp_layers_refuses_a_model_with_them():
    with pytest.raises(ConfigError) as info:
        hf_architecture(tiny_cfg(mtp_depth=1))
    assert info.value.field == "model.mtp_depth"


@pytest.mark.parametrize("name", list(MOE))
def test_moe_export_gives_transformers_our_logits(tmp_path, name):
    cfg, architecture = MOE[name]
    assert hf_architecture(cfg) == architecture
    model = random_model(cfg)
    folder = export_hf(model, cfg, tmp_path / "hf")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [architecture]
    assert_logits_match(model, folder)


@pytest.mark.parametrize("name", list(MOE))
def test_moe_round_trip_is_bitwise_router_bias_included(tmp_path, name):
    cfg, _ = MOE[name]
    model = random_model(cfg)
    export_hf(model, cfg, tmp_path / "hf")
    found, state = import_hf(tmp_path / "hf")
    expected = model.state_dict()
    assert_state_dicts_bitwise_equal(state, expected)
    for field in ("num_experts", "moe_top_k", "moe_frequency", "moe_router", "moe_shared_experts"):
        assert getattr(found, field) == getattr(cfg, field), field
    biases = [k for k in expected if k.endswith("expert_bias")]
    assert bool(biases) == (cfg.moe_router == "sigmoid")
    for key in biases:
        assert expected[key].abs().min() > 0  # a real, non-zero bias made the trip
    fresh = random_model(cfg, seed=9)
    load_hf_into(fresh, tmp_path / "hf")
    assert_state_dicts_bitwise_equal(fresh.state_dict(), expected)


def _transformers_moe(kind: str) -> Any:
    """A tiny MoE model made by transformers itself, with a non-zero router bias (GLM)."""
    shape = dict(HF_TINY, num_experts_per_tok=2)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**shape, intermediate_size=16, num_local_experts=4)
        cls = transformers.MixtralForCausalLM
    else:
        config = transformers.Glm4MoeConfig(
            **shape,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            norm_topk_prob=True,
            partial_rotary_factor=1.0,
        )
        cls = transformers.Glm4MoeForCausalLM
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.2 * torch.randn(buffer.shape))
    return model


@pytest.mark.parametrize("kind", ["mixtral", "glm4_moe"])
def test_an_moe_model_saved_by_transformers_imports_with_its_logits(tmp_path, kind):
    hf = _transformers_moe(kind)
    hf.save_pretrained(tmp_path / "hf")
    found, state = import_hf(tmp_path / "hf")
    model = Transformer(found)
    model.load_state_dict(state)
    ids = random_ids(found)
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (our_logits(model.eval(), ids) - theirs).abs().max().item() < logits_atol(found, theirs)


def test_the_sigmoid_routers_bias_reaches_transformers_routing(tmp_path):
    """Zeroing the exported e_score_correction_bias changes the logits: the bias is used,
    and the match above is not an accident of a bias too small to change any choice."""
    cfg, _ = MOE["sigmoid-top2-shared-glm4moe"]
    model = random_model(cfg)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, Router) and module.expert_bias is not None:
                module.expert_bias.copy_(torch.tensor([3.0, -3.0, 3.0, -3.0, 0.0, 0.0]))
    folder = export_hf(model, cfg, tmp_path / "hf")
    hf = assert_logits_match(model, folder)
    ids = random_ids(cfg)
    with torch.no_grad():
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.zero_()
        unbiased = hf(ids).logits
    assert (unbiased - our_logits(model, ids)).abs().max().item() > 1e-2


# --- Refusals: export -------------------------------------------------------------------------


def test_export_refuses_a_vision_language_model(tmp_path):
    with pytest.raises(ConfigError) as info:
        export_hf(nn.Linear(2, 2), tiny_cfg(), tmp_path / "hf")
    assert info.value.field == "vlm"


def test_export_refuses_a_pipeline_stage(tmp_path):
    cfg = tiny_cfg()
    model = random_model(cfg)
    model.keep_layers(0, 1)
    with pytest.raises(ConfigError) as info:
        export_hf(model, cfg, tmp_path / "hf")
    assert info.value.field == "distributed.pp"


def test_export_refuses_a_config_the_model_was_not_built_from(tmp_path):
    model = random_model(tiny_cfg())
    with pytest.raises(ConfigError) as info:
        export_hf(model, tiny_cfg(rope_theta=500000.0), tmp_path / "hf")
    assert info.value.field == "model.rope_theta"


def test_export_refuses_a_model_field_it_does_not_know(tmp_path):
    """A feature added to ModelConfig later (here an attention bias) stops the export
    until the exporter learns it, instead of vanishing from the written model."""

    @dataclasses.dataclass
    class WithBias(ModelConfig):
        attention_bias: bool = False

    cfg = WithBias(**TINY, attention_bias=True)
    with pytest.raises(ConfigError) as info:
        export_hf(random_model(tiny_cfg()), cfg, tmp_path / "hf")
    assert info.value.field == "model.attention_bias"
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        (dict(num_experts=4, moe_shared_experts=1), "model.moe_shared_experts"),
        (
            dict(n_layers=4, num_experts=4, moe_router="sigmoid", moe_frequency=2),
            "model.moe_frequency",
        ),
        (dict(num_experts=1, moe_top_k=1, moe_router="sigmoid"), "model.num_experts"),
    ],
    ids=["softmax-shared-experts", "sigmoid-interleaved", "sigmoid-one-expert"],
)
def test_export_refuses_moe_no_class_represents(tmp_path, fields, field):
    cfg = tiny_cfg(**fields)
    with pytest.raises(ConfigError) as info:
        hf_architecture(cfg)
    assert info.value.field == field
    with pytest.raises(ConfigError):
        export_hf(random_model(cfg), cfg, tmp_path / "hf")


def test_llama_export_refuses_an_moe_model(tmp_path):
    cfg, _ = MOE["softmax-top2-mixtral"]
    with pytest.raises(ConfigError) as info:
        export_hf(random_model(cfg), cfg, tmp_path / "hf", model_type="llama")
    assert info.value.field == "model.num_experts"


# --- Refusals: import -------------------------------------------------------------------------


@pytest.fixture
def llama_folder(tmp_path) -> Path:
    cfg = DENSE["gqa"]
    return export_hf(random_model(cfg), cfg, tmp_path / "hf", model_type="llama")


def rewrite_weights(folder: Path, change) -> None:
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def rewrite_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_import_refuses_another_architecture(llama_folder):
    rewrite_config(llama_folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(HFFolderError) as info:
        import_hf(llama_folder)
    assert "model_type = 'gpt2'" in str(info.value) and "config.json" in str(info.value)


def test_import_llama_refuses_an_moe_folder(tmp_path):
    cfg, _ = MOE["softmax-top2-mixtral"]
    export_hf(random_model(cfg), cfg, tmp_path / "hf")
    with pytest.raises(HFFolderError, match="model_type = 'mixtral'"):
        import_hf(tmp_path / "hf", model_type="llama")


def test_import_names_a_missing_tensor(llama_folder):
    rewrite_weights(llama_folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(HFFolderError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        import_hf(llama_folder)


def test_import_names_a_mis_shaped_tensor(llama_folder):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)

    rewrite_weights(llama_folder, shrink)
    with pytest.raises(HFFolderError) as info:
        import_hf(llama_folder)
    message = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight has shape (8, 32)" in message
    assert "(16, 32)" in message


def test_import_refuses_a_tensor_it_would_ignore(llama_folder):
    def add_bias(tensors):
        tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(32)

    rewrite_weights(llama_folder, add_bias)
    with pytest.raises(HFFolderError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias"):
        import_hf(llama_folder)


def test_import_never_reads_pickled_weights(llama_folder):
    (llama_folder / "model.safetensors").unlink()
    (llama_folder / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(HFFolderError, match="pytorch_model.bin.*never read"):
        import_hf(llama_folder)


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}, "rope_parameters"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"head_dim": 16}, "head_dim"),
    ],
)
def test_import_refuses_a_feature_we_lack(llama_folder, changes, key):
    rewrite_config(llama_folder, **changes)
    with pytest.raises(HFFolderError) as info:
        import_hf(llama_folder)
    assert str(info.value).split(": ", 1)[1].startswith(f"{key} = ")


def test_import_refuses_mixtral_top1_and_qwen_gated_shared_experts(tmp_path):
    cfg, _ = MOE["softmax-top2-mixtral"]
    mixtral = export_hf(random_model(cfg), cfg, tmp_path / "mixtral")
    rewrite_config(mixtral, num_experts_per_tok=1)
    with pytest.raises(HFFolderError, match="num_experts_per_tok = 1"):
        import_hf(mixtral)
    cfg, _ = MOE["softmax-top1-qwen2moe"]
    qwen = export_hf(random_model(cfg), cfg, tmp_path / "qwen")
    rewrite_config(qwen, shared_expert_intermediate_size=8)
    with pytest.raises(HFFolderError, match="shared_expert_intermediate_size = 8"):
        import_hf(qwen)


def test_import_refuses_a_non_zero_qwen_attention_bias(tmp_path):
    cfg, _ = MOE["softmax-top1-qwen2moe"]
    folder = export_hf(random_model(cfg), cfg, tmp_path / "hf")

    def set_bias(tensors):
        tensors["model.layers.1.self_attn.v_proj.bias"][0] = 0.5

    rewrite_weights(folder, set_bias)
    with pytest.raises(
        HFFolderError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias is not zero"
    ):
        import_hf(folder)


def test_import_reads_a_sharded_folder_and_refuses_a_shard_outside_it(llama_folder):
    tensors = load_file(llama_folder / "model.safetensors")
    (llama_folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[:5],
        "model-00002-of-00002.safetensors": names[5:],
    }
    weight_map = {}
    for shard, part in shards.items():
        save_file({n: tensors[n] for n in part}, llama_folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    index = llama_folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _, state = import_hf(llama_folder)
    assert torch.equal(state["tok_embeddings.weight"], tensors["model.embed_tokens.weight"])
    index.write_text(json.dumps({"weight_map": {names[0]: "../elsewhere.safetensors"}}))
    with pytest.raises(HFFolderError, match="outside the folder"):
        import_hf(llama_folder)


# --- Tokenizer --------------------------------------------------------------------------------


def test_export_copies_a_hugging_face_tokenizer(tmp_path):
    from tests.support.data_files import make_hf_tokenizer

    pytest.importorskip("tokenizers")
    tokenizer = make_hf_tokenizer(tmp_path / "tok" / "tokenizer.json")
    cfg = tiny_cfg(vocab_size=300)
    folder = export_hf(random_model(cfg), cfg, tmp_path / "hf", tokenizer)
    assert (folder / "tokenizer.json").read_bytes() == Path(tokenizer).read_bytes()
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["eos_token_id"] == loaded.convert_tokens_to_ids("<|endoftext|>")
    assert config["bos_token_id"] == loaded.convert_tokens_to_ids("<s>")
    assert loaded.eos_token == "<|endoftext|>"
    text = "def add(a, b): return a + b"
    from kempnerforge.data.tokenizer import load_tokenizer

    assert loaded(text, add_special_tokens=False)["input_ids"] == load_tokenizer(tokenizer).encode(
        text
    )


def test_export_copies_every_file_of_a_tokenizer_directory(tmp_path):
    from tests.support.data_files import make_hf_tokenizer

    pytest.importorskip("tokenizers")
    source = tmp_path / "tok"
    make_hf_tokenizer(source / "tokenizer.json")
    (source / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    (source / "unrelated.txt").write_text("not a tokenizer file")
    cfg = tiny_cfg(vocab_size=300)
    folder = export_hf(random_model(cfg), cfg, tmp_path / "hf", str(source))
    assert (folder / "tokenizer_config.json").read_text() == '{"model_max_length": 64}'
    assert (folder / "tokenizer.json").is_file() and not (folder / "unrelated.txt").exists()


def test_export_of_a_byte_tokenizer_job_writes_no_tokenizer(tmp_path):
    cfg = tiny_cfg()
    folder = export_hf(random_model(cfg), cfg, tmp_path / "hf", "byte")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors"]


# --- Command line -----------------------------------------------------------------------------


def export_args(checkpoint: str, out: Path, config: str = "") -> argparse.Namespace:
    return argparse.Namespace(checkpoint=checkpoint, out=str(out), format="hf", config=config)


def test_export_and_import_arguments_parse():
    from kempnerforge.commands.hf import add_export_arguments, add_import_arguments

    parser = argparse.ArgumentParser()
    add_export_arguments(parser)
    args = parser.parse_args(["--checkpoint", "c", "--out", "o"])
    assert (args.checkpoint, args.out, args.format, args.config) == ("c", "o", "hf", "")
    parser = argparse.ArgumentParser()
    add_import_arguments(parser)
    args = parser.parse_args(["--model", "m", "--out", "o"])
    assert (args.model, args.out) == ("m", "o")


def test_import_hf_writes_a_model_table_and_a_checkpoint_training_starts_from(tmp_path):
    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.commands.hf import run_import
    from kempnerforge.config.checkpoint import CheckpointConfig
    from kempnerforge.config.loader import load_config

    cfg, _ = MOE["sigmoid-top2-shared-glm4moe"]
    model = random_model(cfg)
    export_hf(model, cfg, tmp_path / "hf")
    out = tmp_path / "imported"
    args = argparse.Namespace(model=str(tmp_path / "hf"), out=str(out))
    assert run_import(args, ["--model.max_seq_len=32", "--model.moe_bias_update_rate=0.01"]) == 0
    job = tmp_path / "job.toml"
    job.write_text(f'include = ["{out / "model.toml"}"]\n[model]\ninit_std = 0.05\n')
    config = load_config(str(job))
    assert config.model.max_seq_len == 32 and config.model.moe_bias_update_rate == 0.01
    assert dataclasses.replace(config.model, max_seq_len=64, moe_bias_update_rate=0.001) == (
        dataclasses.replace(
            cfg,
            init_std=0.05,
            n_kv_heads=cfg.kv_heads,
            ffn_hidden_dim=cfg.hidden_dim,
            multiple_of=256,
        )
    )
    fresh = random_model(config.model, seed=5)
    manager = CheckpointManager(CheckpointConfig(), str(out))
    manager.load_weights(str(out / "step_0"), model=fresh)
    assert_state_dicts_bitwise_equal(fresh.state_dict(), model.state_dict())


def test_import_hf_refuses_an_override_the_weights_fix(tmp_path):
    from kempnerforge.commands.hf import run_import

    cfg = DENSE["untied"]
    export_hf(random_model(cfg), cfg, tmp_path / "hf")
    args = argparse.Namespace(model=str(tmp_path / "hf"), out=str(tmp_path / "out"))
    with pytest.raises(ConfigError) as info:
        run_import(args, ["--model.dim=64"])
    assert info.value.field == "model.dim"
    with pytest.raises(ConfigError) as info:
        run_import(args, ["--train.max_steps=3"])
    assert info.value.field == "<override>"
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_export_cli_writes_the_checkpoint_of_a_training_run(tmp_path, tiny_overrides):
    """Train a few steps, export the checkpoint with `kempnerforge export`'s function, and
    compare transformers' logits with our model loaded from the same checkpoint."""
    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.commands.hf import run_export
    from kempnerforge.config.loader import save_config
    from kempnerforge.model.transformer import build_model
    from kempnerforge.training.loop import run_training_loop
    from tests.support.resume import make_session

    overrides = [
        *[o for o in tiny_overrides if not o.startswith("--checkpoint.interval")],
        "--checkpoint.interval=3",
        "--train.max_steps=3",
        "--model.n_kv_heads=1",
        "--model.tie_embeddings=true",
    ]
    session = make_session(overrides)
    with session.tracker:
        run_training_loop(session)
    config = session.config
    run_dir = Path(config.run_dir)
    save_config(config, str(run_dir / "config.toml"))
    checkpoint = str(run_dir / "checkpoints" / "step_3")

    ours = build_model(config.model)
    CheckpointManager(config.checkpoint, config.checkpoint_dir).load_weights(checkpoint, model=ours)
    ids = random_ids(config.model)
    expected = our_logits(ours.eval(), ids)

    assert run_export(export_args(checkpoint, tmp_path / "hf"), []) == 0
    with torch.no_grad():
        theirs = hf_model(tmp_path / "hf")(ids).logits
    assert (theirs - expected).abs().max().item() < logits_atol(config.model, theirs)

    # Without config.toml the config recorded in the checkpoint rebuilds the same model.
    (run_dir / "config.toml").unlink()
    assert run_export(export_args(checkpoint, tmp_path / "hf2"), []) == 0
    assert (
        load_file(tmp_path / "hf2" / "model.safetensors").keys()
        == load_file(tmp_path / "hf" / "model.safetensors").keys()
    )

    # An override that changes the function the weights compute is refused by name.
    with pytest.raises(ConfigError) as info:
        run_export(export_args(checkpoint, tmp_path / "hf3"), ["--model.rope_theta=500000.0"])
    assert info.value.field == "model.rope_theta"
    with pytest.raises(ConfigError) as info:
        run_export(export_args(checkpoint, tmp_path / "hf"), [])
    assert info.value.field == "--out"
    assert not (tmp_path / "hf3").exists()


@pytest.mark.slow
def test_training_starts_from_an_imported_model_as_import_hf_says(tmp_path, tiny_overrides):
    """The steps import-hf prints: include its model.toml, resume_from its step_0 with
    load_weights_only; the run's model then holds the Hugging Face weights, at step 0."""
    from kempnerforge.commands.hf import run_import
    from kempnerforge.config.loader import load_config
    from kempnerforge.distributed.runtime import RuntimeContext
    from kempnerforge.training.build import build_session
    from kempnerforge.training.loop import run_training_loop
    from kempnerforge.training.resume_plan import apply_resume, plan_resume

    cfg = tiny_cfg(n_layers=2, n_heads=2, n_kv_heads=1, tie_embeddings=True, init_std=0.02)
    model = random_model(cfg)
    export_hf(model, cfg, tmp_path / "hf")
    out = tmp_path / "imported"
    assert run_import(argparse.Namespace(model=str(tmp_path / "hf"), out=str(out)), []) == 0
    job = tmp_path / "job.toml"
    job.write_text(f'include = ["{out / "model.toml"}"]\n')
    overrides = [o for o in tiny_overrides if not o.startswith("--model.")]
    overrides += [
        f"--checkpoint.resume_from={out / 'step_0'}",
        "--checkpoint.load_weights_only=true",
        "--train.max_steps=2",
    ]
    config = load_config(str(job), overrides)
    config.validate(1)
    session = build_session(config, RuntimeContext())
    plan = plan_resume(config, session.checkpointer)
    assert apply_resume(session, plan) == (0, 0)
    assert_state_dicts_bitwise_equal(session.model.state_dict(), model.state_dict())
    with session.tracker:
        assert run_training_loop(session)[0] == 2
