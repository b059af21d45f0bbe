"""[lora]: the adapter's function and merge, which projections it goes on, what trains, and
the config's refusals (the parallel layouts, peft and transformers: tests/e2e/test_lora.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kempnerforge.config.loader import load_config
from kempnerforge.config.lora import LoRAConfig
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model.lora import (
    LoRALinear,
    add_adapters,
    apply_lora,
    freeze_base,
    lora_modules,
    merge_lora,
)
from kempnerforge.model.meta import on_meta
from kempnerforge.model.transformer import Transformer

TINY = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=16)


def adapted_linear(rank: int = 3, alpha: float = 6.0, seed: int = 0) -> LoRALinear:
    torch.manual_seed(seed)
    layer = LoRALinear(8, 5, True, rank=rank, alpha=alpha, dropout=0.0)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_()
    return layer


def test_the_adapter_adds_alpha_over_rank_times_its_low_rank_product():
    layer = adapted_linear()
    x = torch.randn(4, 8, dtype=torch.float64)
    w, b = layer.weight.double(), layer.bias.double()
    a, up = layer.lora_a.double(), layer.lora_b.double()
    want = x @ w.T + b + (6.0 / 3) * (x @ a.T) @ up.T
    got = layer.double()(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_dropout_touches_only_the_adapters_input_and_only_in_training():
    layer = adapted_linear()
    layer.dropout = 0.5
    x = torch.randn(64, 8)
    base = nn.functional.linear(x, layer.weight, layer.bias)
    layer.eval()
    assert not torch.equal(layer(x), base)  # the update is there without dropout
    torch.testing.assert_close(layer(x), adapted_linear()(x))
    layer.train()
    with torch.no_grad():
        layer.lora_b.zero_()
    torch.testing.assert_close(layer(x), base)  # B = 0: dropout cannot reach the base


def test_merging_gives_a_plain_projection_computing_the_same():
    attention = nn.Module()
    layer = attention.wq = adapted_linear()
    model = nn.ModuleDict({"attention": attention})
    want_weight = layer.weight + 2.0 * layer.lora_b @ layer.lora_a
    x = torch.randn(3, 8)
    want = layer(x)
    assert merge_lora(model) == 1
    merged = model.get_submodule("attention.wq")
    assert type(merged) is nn.Linear
    assert torch.equal(merged.weight, want_weight.detach())
    torch.testing.assert_close(merged(x), want)


def test_adapters_go_on_the_named_projections_of_every_block_and_the_weights_keep_their_names():
    model = Transformer(TINY)
    before = dict(model.named_parameters())
    adapted = apply_lora(model, ("wq", "wv", "w2"), rank=2, alpha=4.0, dropout=0.0)
    projections = ("attention.wq", "attention.wv", "feed_forward.w2")
    assert adapted == [f"layers.{i}.{p}" for i in range(2) for p in projections]
    after = dict(model.named_parameters())
    assert all(after[name] is param for name, param in before.items())  # shared, not copied
    assert sorted(set(after) - set(before)) == sorted(
        f"{path}.lora_{ab}" for path in adapted for ab in "ab"
    )


def test_the_seeded_init_starts_the_adapted_model_as_the_base():
    torch.manual_seed(0)
    base = Transformer(TINY)
    base.init_weights(seed=5)
    adapted = Transformer(TINY)
    apply_lora(adapted, ("wq", "wo", "w1"), rank=4, alpha=8.0, dropout=0.0)
    adapted.init_weights(seed=5)
    for path, module in lora_modules(adapted).items():
        assert torch.count_nonzero(module.lora_b) == 0
        assert module.lora_a.std().item() == pytest.approx(1 / 4, rel=0.25)
        assert torch.equal(module.weight, base.get_parameter(f"{path}.weight"))
    ids = torch.randint(0, 64, (2, 16))
    assert torch.equal(adapted(ids), base(ids))


def test_only_the_adapters_train():
    model = Transformer(TINY)
    apply_lora(model, ("wq", "wk"), rank=2, alpha=2.0, dropout=0.0)
    trainable, frozen = freeze_base(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(n.endswith((".lora_a", ".lora_b")) for n in names)
    # Per layer: wq's A (2, 32) and B (32, 2), wk's A (2, 32) and B (16, 2): 2 kv heads of 8.
    assert trainable == 2 * (2 * 32 + 32 * 2 + 2 * 32 + 16 * 2)
    assert trainable + frozen == sum(p.numel() for p in model.parameters())


def test_a_target_the_model_lacks_is_refused_naming_the_field():
    moe = ModelConfig(
        dim=32, n_layers=2, n_heads=4, vocab_size=64, num_experts=4, moe_top_k=2, max_seq_len=16
    )
    with on_meta():
        model = Transformer(moe)
    with pytest.raises(ConfigError) as info:
        add_adapters(model, LoRAConfig(rank=2, target_modules=["wq", "w1"]))
    message = str(info.value)
    assert message.startswith("lora.target_modules = ['wq', 'w1']")
    assert "w1 is in no decoder block" in message and "experts" in message


def test_hugging_face_names_are_accepted_and_read_as_ours():
    lora = LoRAConfig(rank=8, target_modules=["q_proj", "v_proj", "wq", "down_proj"])
    assert lora.projections == ("wq", "wv", "w2")


@pytest.mark.parametrize(
    "overrides, start",
    [
        (["--lora.rank=-1"], "lora.rank = -1"),
        (["--lora.rank=4", "--lora.alpha=0"], "lora.alpha = 0"),
        (["--lora.rank=4", "--lora.dropout=1.0"], "lora.dropout = 1.0"),
        (["--lora.rank=4", '--lora.target_modules=["q_prj"]'], "lora.target_modules = ['q_prj']"),
        (["--lora.rank=4", "--lora.target_modules=[]"], "lora.target_modules = []"),
    ],
)
def test_bad_lora_fields_are_refused_naming_them(overrides, start):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert str(info.value).startswith(start)


def test_a_misspelt_target_gets_a_suggestion():
    with pytest.raises(ConfigError) as info:
        LoRAConfig(rank=4, target_modules=["q_prj"])
    assert "did you mean 'q_proj'?" in str(info.value)


def test_fp8_layers_are_refused_with_adapters():
    config = load_config(None, ["--lora.rank=4", "--train.float8=true", "--model.dim=64"])
    with pytest.raises(ConfigError) as info:
        config.validate(1)
    assert str(info.value).startswith("train.float8 = True: expected false with lora.rank > 0")
