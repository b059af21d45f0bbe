"""A new Hugging Face architecture is one file and one registration: a Llama whose tensors
have other names and whose q/k/v and gate/up projections are fused, defined and registered
in this file alone, exports, imports bit for bit and goes through `kempnerforge import-hf`
with no edit to hf.py, the commands or the other architectures."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from kempnerforge.checkpoint.manager import CheckpointManager
from kempnerforge.cli import main
from kempnerforge.config.checkpoint import CheckpointConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.interop.architectures import (
    ARCHITECTURES,
    LLAMA,
    Architecture,
    HFConfig,
    HFTensors,
    Requirement,
    Shapes,
    State,
    common_model_fields,
)
from kempnerforge.interop.hf import (
    SUPPORTED_MODEL_TYPES,
    export_hf,
    hf_architecture,
    import_hf,
    load_hf_into,
)
from kempnerforge.interop.hf_files import HFFolderError
from kempnerforge.model.transformer import Transformer

# --- The architecture: what a new module of interop/architectures/ would hold ----------------


def _prefixes(index: int) -> tuple[str, str]:
    return f"layers.{index}.", f"transformer.blocks.{index}."


def fused_renamed(cfg: ModelConfig) -> list[tuple[str, str]]:
    """The tensors copied as they are, under this class's names."""
    pairs = [
        ("tok_embeddings.weight", "transformer.embed.weight"),
        ("norm.weight", "transformer.final_norm.weight"),
    ]
    if not cfg.tie_embeddings:
        pairs.append(("output.weight", "head.weight"))
    for index in range(cfg.n_layers):
        ours, theirs = _prefixes(index)
        pairs += [
            (f"{ours}attention.wo.weight", f"{theirs}attn.out.weight"),
            (f"{ours}attention_norm.weight", f"{theirs}norm_1.weight"),
            (f"{ours}ffn_norm.weight", f"{theirs}norm_2.weight"),
            (f"{ours}feed_forward.w2.weight", f"{theirs}mlp.down.weight"),
        ]
    return pairs


FUSED = {"attn.qkv": ("attention.wq", "attention.wk", "attention.wv")}
FUSED["mlp.gate_up"] = ("feed_forward.w1", "feed_forward.w3")
"""Each fused tensor of a block and our tensors it stacks, in order, along the output dim."""


def fused_to_hf(state: State, cfg: ModelConfig) -> State:
    out: State = {}
    for index in range(cfg.n_layers):
        ours, theirs = _prefixes(index)
        for fused, parts in FUSED.items():
            out[f"{theirs}{fused}.weight"] = torch.cat([state[f"{ours}{p}.weight"] for p in parts])
    return out


def fused_from_hf(source: HFTensors, hf: HFConfig, cfg: ModelConfig, shapes: Shapes) -> State:
    del hf
    state: State = {}
    for index in range(cfg.n_layers):
        ours, theirs = _prefixes(index)
        for fused, parts in FUSED.items():
            names = [f"{ours}{p}.weight" for p in parts]
            rows = [shapes[name][0] for name in names]
            whole = source.take(f"{theirs}{fused}.weight", (sum(rows), cfg.dim))
            state.update(zip(names, whole.split(rows), strict=True))
    return state


def fused_config_fields(hf: HFConfig) -> dict[str, Any]:
    hf.require("fused_projections", True, None, "this class stores q/k/v and gate/up fused")
    fields = common_model_fields(hf, llama_defaults=False)
    fields["ffn_hidden_dim"] = hf.get_int("intermediate_size")
    return fields


FUSED_LLAMA = Architecture(
    model_type="fused_llama",
    hf_class="FusedLlamaForCausalLM",
    requires=(
        Requirement(
            "num_experts", lambda cfg: not cfg.is_moe, "0 for FusedLlamaForCausalLM", "dense"
        ),
    ),
    config_fields=fused_config_fields,
    config_keys=lambda cfg: {"intermediate_size": cfg.hidden_dim, "fused_projections": True},
    renamed=fused_renamed,
    tensors_to_hf=fused_to_hf,
    tensors_from_hf=fused_from_hf,
)


@pytest.fixture
def fused_llama():
    ARCHITECTURES.register(FUSED_LLAMA)
    yield FUSED_LLAMA
    ARCHITECTURES.unregister(FUSED_LLAMA)


# --- The tests ----------------------------------------------------------------------------------

TINY: dict[str, Any] = dict(dim=32, n_layers=2, n_heads=4, vocab_size=259, max_seq_len=64)


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """Random weights everywhere, the norms too (their init is a constant)."""
    model = Transformer(cfg)
    model.init_weights(seed)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))
    return model.eval()


def assert_bitwise_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), f"{name} differs"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_registered_architecture_round_trips_a_model_bitwise(tmp_path, fused_llama, tied):
    cfg = ModelConfig(**TINY, n_kv_heads=2, tie_embeddings=tied, ffn_hidden_dim=40)
    model = random_model(cfg)
    folder = export_hf(model, cfg, tmp_path / "hf", "byte", model_type="fused_llama")

    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == (
        "fused_llama",
        ["FusedLlamaForCausalLM"],
    )
    names = set(load_file(folder / "model.safetensors"))
    assert {theirs for _, theirs in fused_renamed(cfg)} < names
    assert "transformer.blocks.1.attn.qkv.weight" in names
    assert not any(name.startswith("model.") for name in names)  # none of Llama's names

    found, state = import_hf(folder)  # chosen by the folder's model_type
    assert_bitwise_equal(state, model.state_dict())
    assert (found.kv_heads, found.hidden_dim, found.tie_embeddings) == (2, 40, tied)
    fresh = random_model(cfg, seed=7)
    load_hf_into(fresh, folder)
    assert_bitwise_equal(fresh.state_dict(), model.state_dict())


def test_import_hf_writes_a_checkpoint_of_a_registered_architecture(tmp_path, fused_llama):
    cfg = ModelConfig(**TINY)
    model = random_model(cfg)
    export_hf(model, cfg, tmp_path / "hf", model_type="fused_llama")
    out = tmp_path / "imported"
    assert main(["import-hf", "--model", str(tmp_path / "hf"), "--out", str(out)]) == 0
    fresh = random_model(cfg, seed=3)
    CheckpointManager(CheckpointConfig(), str(out)).load_weights(str(out / "step_0"), model=fresh)
    assert_bitwise_equal(fresh.state_dict(), model.state_dict())


def test_export_prefers_the_earlier_registered_architecture(fused_llama):
    """Both represent a dense model; Llama, registered first, is chosen. The new one is
    listed after the others and refuses what its requirements exclude."""
    assert hf_architecture(ModelConfig(**TINY)) == "LlamaForCausalLM"
    assert list(SUPPORTED_MODEL_TYPES)[-1] == "fused_llama"
    cfg = ModelConfig(**TINY, num_experts=4)
    with pytest.raises(ConfigError) as info:
        export_hf(random_model(cfg), cfg, "unused", model_type="fused_llama")
    assert info.value.field == "model.num_experts"


def test_an_unregistered_architecture_is_refused_by_name(tmp_path):
    cfg = ModelConfig(**TINY)
    ARCHITECTURES.register(FUSED_LLAMA)
    try:
        folder = export_hf(random_model(cfg), cfg, tmp_path / "hf", model_type="fused_llama")
    finally:
        ARCHITECTURES.unregister(FUSED_LLAMA)
    assert "fused_llama" not in SUPPORTED_MODEL_TYPES
    with pytest.raises(HFFolderError) as error:
        import_hf(folder)
    message = str(error.value)
    assert "config.json: model_type = 'fused_llama'" in message
    assert f"expected one of {', '.join(SUPPORTED_MODEL_TYPES)} (the" in message
    with pytest.raises(ConfigError) as info:
        export_hf(random_model(cfg), cfg, tmp_path / "again", model_type="fused_llama")
    assert info.value.field == "model_type"


def test_a_model_type_is_registered_once():
    with pytest.raises(ValueError, match="'llama' .* already registered, by LlamaForCausalLM"):
        ARCHITECTURES.register(dataclasses.replace(LLAMA, hf_class="OtherLlamaForCausalLM"))


def test_a_field_added_to_the_model_needs_an_architecture_that_lists_it():
    """A ModelConfig field added later (here an attention bias) is refused by every
    architecture that does not list it in own_fields, and taken by one that does."""

    @dataclasses.dataclass
    class WithBias(ModelConfig):
        attention_bias: bool = False

    cfg = WithBias(**TINY, attention_bias=True)
    with pytest.raises(ConfigError) as info:
        ARCHITECTURES.for_config(cfg)
    assert info.value.field == "model.attention_bias"
    assert ARCHITECTURES.for_config(WithBias(**TINY)) is LLAMA
    listing = dataclasses.replace(FUSED_LLAMA, own_fields=("attention_bias",))
    ARCHITECTURES.register(listing)
    try:
        assert ARCHITECTURES.for_config(cfg) is listing
    finally:
        ARCHITECTURES.unregister(listing)
