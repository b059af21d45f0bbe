"""Sliding-window attention as a model option: the [model] fields and their rules, which
layers slide (Mistral, Gemma 3, GPT-OSS, a per-layer list), and the model's forward and
gradients with windows and packed documents on each kernel, compiled blocks included."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters

from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.distributed.parallelize import apply_compile
from kempnerforge.model.transformer import Transformer
from tests.support.tolerance import assert_reordered_close, transformer_terms

SEQ = 40


def config(**overrides: object) -> ModelConfig:
    fields: dict = dict(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=97)
    fields.update(max_seq_len=64, init_std=0.1)
    fields.update(overrides)
    return ModelConfig(**fields)


def windows(cfg: ModelConfig) -> list[int]:
    return [cfg.layer_window(i) for i in range(cfg.n_layers)]


def test_which_layers_slide_follows_each_family():
    assert windows(config()) == [0, 0, 0, 0]
    assert windows(config(sliding_window=8)) == [8, 8, 8, 8]  # Mistral: every layer
    assert windows(config(sliding_window=8, sliding_window_pattern=2)) == [8, 0, 8, 0]  # GPT-OSS
    gemma3 = config(n_layers=12, sliding_window=8, sliding_window_pattern=6)
    assert windows(gemma3) == [8] * 5 + [0] + [8] * 5 + [0]  # five local, then one global
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert windows(config(sliding_window=8, layer_types=types)) == [0, 8, 8, 0]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sliding_window": -1}, "model.sliding_window = -1: expected an integer >= 0"),
        ({"sliding_window_pattern": 2}, "model.sliding_window_pattern = 2: expected 0 when"),
        (
            {"sliding_window": 8, "sliding_window_pattern": 1},
            "model.sliding_window_pattern = 1: expected 0 (every layer slides) or 2 to "
            "model.n_layers = 4",
        ),
        (
            {"sliding_window": 8, "layer_types": ["sliding_attention"]},
            "model.layer_types = ['sliding_attention']: expected one entry per layer",
        ),
        (
            {"sliding_window": 8, "layer_types": ["sliding_attention", "full", "x", "y"]},
            "model.layer_types[1] = 'full': expected one of",
        ),
        (
            {"layer_types": ["sliding_attention", "full_attention"] * 2},
            "model.sliding_window = 0: expected a window > 0",
        ),
        (
            {"sliding_window": 8, "layer_types": ["full_attention"] * 4},
            "model.sliding_window = 8: expected 0 when no layer is 'sliding_attention'",
        ),
        (
            {
                "sliding_window": 8,
                "sliding_window_pattern": 2,
                "layer_types": ["full_attention", "sliding_attention"] * 2,
            },
            "model.sliding_window_pattern = 2: expected 0 when model.layer_types is given",
        ),
    ],
)
def test_bad_window_settings_are_refused_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config(**overrides)


def test_the_fields_load_from_overrides_as_a_hugging_face_list():
    types = "['sliding_attention','full_attention','sliding_attention','full_attention']"
    cfg = load_config(None, ["--model.sliding_window=16", f"--model.layer_types={types}"])
    assert windows(cfg.model)[:4] == [16, 0, 16, 0]


def packed_batch(seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (batch, SEQ), generator=gen)
    doc_ids = torch.zeros(batch, SEQ, dtype=torch.long)
    for row in range(batch):
        for cut in torch.randint(1, SEQ, (2,), generator=gen).tolist():
            doc_ids[row, cut:] += 1
    return ids, doc_ids


def forward_and_grads(model: Transformer, ids, doc_ids) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    logits = model(ids, doc_ids)
    assert isinstance(logits, torch.Tensor)
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_windows_change_what_a_model_computes():
    """The window binds: the same weights without it give other logits past the window."""
    torch.manual_seed(0)
    windowed = Transformer(config(sliding_window=6, sliding_window_pattern=2))
    plain = Transformer(config())
    plain.load_state_dict(windowed.state_dict())
    ids, _ = packed_batch(0)
    with torch.no_grad():
        a, b = windowed(ids), plain(ids)
    assert torch.equal(a[:, :6], b[:, :6])  # the first 6 positions see no farther anyway
    assert (a[:, 6:] - b[:, 6:]).abs().max() > 1e-2


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_the_cpu_kernel_and_the_dense_mask_train_alike_with_windows_and_documents(kv_heads):
    torch.manual_seed(0)
    model = Transformer(config(n_kv_heads=kv_heads, sliding_window=6, sliding_window_pattern=2))
    ids, doc_ids = packed_batch(1)
    logits, grads = forward_and_grads(model, ids, doc_ids)
    model.attention_kernel = "dense"
    dense_logits, dense_grads = forward_and_grads(model, ids, doc_ids)
    # Two attention kernels: the same sums in other orders along the model's chain.
    terms = transformer_terms(model.cfg, SEQ)
    assert_reordered_close(logits, dense_logits, terms=terms)
    for name, grad in grads.items():
        assert_reordered_close(grad, dense_grads[name], terms=terms + SEQ * 2)


def test_compiled_blocks_trace_the_mask_once_and_match_eager():
    """Compiled blocks (aot_eager: the traced graph run by eager kernels) take the rule's
    dense mask inside the graph on the CPU; a batch with other documents reuses the graph."""
    torch.manual_seed(0)
    model = Transformer(config(sliding_window=6, sliding_window_pattern=2))
    ids, doc_ids = packed_batch(2)
    eager, eager_grads = forward_and_grads(model, ids, doc_ids)
    torch._dynamo.reset()
    counters.clear()
    apply_compile(model, backend="aot_eager")
    compiled, grads = forward_and_grads(model, ids, doc_ids)
    graphs = counters["stats"]["unique_graphs"]
    forward_and_grads(model, *packed_batch(3))
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0
    terms = transformer_terms(model.cfg, SEQ)
    assert_reordered_close(compiled, eager, terms=terms)
    for name, grad in grads.items():
        assert_reordered_close(grad, eager_grads[name], terms=terms + SEQ * 2)
