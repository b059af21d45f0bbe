"""Decoding through the training forward with a key/value cache (model/attention/
decode_cache.py): rows of different lengths, each at its own positions, give the logits of
the full forward at every position, for every family's attention (grouped heads, sliding
windows, sinks, per-head and projection norms, latent attention, local RoPE tables), with
the padding a sequence-parallel layout adds and with rows that stop early."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.config.loader import load_config
from kempnerforge.model.attention import DecodeCache, DecodeStep
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.objectives.sampling import Decoding, decode_completions
from tests.support.family_options import FAMILY_OPTIONS
from tests.support.tolerance import assert_reordered_close, transformer_terms

SHAPE = ["--model.dim=64", "--model.n_layers=2", "--model.n_heads=4", "--model.max_seq_len=64"]
FAMILIES = ["llama", *FAMILY_OPTIONS]
PROMPTS = [5, 9, 3]
"""Each row's prompt length: the rows reach each position at different steps."""
STEPS = 12
PAD = 0


def family_model(family: str) -> Transformer:
    options = FAMILY_OPTIONS.get(family)
    args = [] if options is None else options.args
    config = load_config(None if options is None else options.config, [*SHAPE, *args])
    model = Transformer(config.model).eval()
    model.init_weights(seed=5)
    return model


def sequences(vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(2)
    return [
        torch.randint(1, vocab, (length + STEPS,), generator=generator).tolist()
        for length in PROMPTS
    ]


def decoded_logits(
    model: Transformer, rows: list[list[int]], multiple: int, width: int, device: str = "cpu"
):
    """Each row's logits at every position it reached, through the cache: the prompts at
    once, then one token per row and step (padded to ``multiple`` positions), the last row
    stopping half-way (padding only from then on, in the slots past ``width``)."""
    cache = DecodeCache(len(rows), width + multiple)
    prefill = -(-max(PROMPTS) // multiple) * multiple
    ids = torch.full((len(rows), prefill), PAD)
    for row, length in enumerate(PROMPTS):
        ids[row, :length] = torch.tensor(rows[row][:length])
    logits = model(ids.to(device), decode=DecodeStep.prefill(cache, prefill, torch.device(device)))
    got = [[logits[row, i] for i in range(length)] for row, length in enumerate(PROMPTS)]
    for step in range(STEPS - 1):
        ids = torch.full((len(rows), multiple), PAD)
        positions = torch.zeros((len(rows), multiple), dtype=torch.long)
        slots = torch.arange(width, width + multiple).repeat(len(rows), 1)
        open_rows = [row for row in range(len(rows)) if row < 2 or step < STEPS // 2]
        for row in open_rows:
            position = PROMPTS[row] + step
            ids[row, 0] = rows[row][position]
            positions[row], slots[row, 0] = position, position
        read = 1 + max(PROMPTS[row] + step for row in open_rows)
        step_ = DecodeStep(cache, positions.to(device), slots.to(device), read)
        logits = model(ids.to(device), decode=step_)
        for row in open_rows:
            got[row].append(logits[row, 0])
    return [torch.stack(row) for row in got]


@pytest.mark.parametrize("multiple", [1, 2])
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_gives_the_full_forwards_logits(family, multiple):
    assert_cached_logits(family, multiple, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_decoding_on_a_gpu_gives_the_full_forwards_logits(family):
    """The same on CUDA (fp32): the full forward there takes SDPA's fused causal kernels."""
    assert_cached_logits(family, 2, "cuda")


def assert_cached_logits(family: str, multiple: int, device: str) -> None:
    model = family_model(family).to(device)
    rows = sequences(model.cfg.vocab_size)
    with torch.no_grad():
        got = decoded_logits(model, rows, multiple, 48, device)
        for row, logits in zip(rows, got, strict=True):
            full = model(torch.tensor([row[: logits.shape[0]]], device=device))
            terms = transformer_terms(model.cfg, logits.shape[0], backward=False)
            assert_reordered_close(logits, full[0], terms=terms)


def test_a_cache_holds_what_each_layer_projects():
    """Each attention layer's cache is made at its first write with that layer's key and
    value shapes (a tensor-parallel rank's own heads): latent attention's query/key heads
    are wider than its values."""
    model = family_model("deepseek_v3")
    cache = DecodeCache(2, 20)
    with torch.no_grad():
        model(torch.ones((2, 4), dtype=torch.long), decode=DecodeStep.prefill(cache, 4, "cpu"))
    keys, values = cache.layers["0"]
    assert keys.shape == (2, 20, 4, 48) and values.shape == (2, 20, 4, 32)
    assert len(cache.layers) == model.cfg.n_layers


def test_sampled_completions_do_not_depend_on_the_padding_or_the_batch():
    """decode_completions with one row per forward, and with every row in one forward and
    a length multiple of 2 (a tp=2 layout's padding), samples the same tokens: each row's
    draws come from its own seeded generator and its logits from its own positions."""
    model = family_model("gemma3")
    prompts = [row[:length] for row, length in zip(sequences(256), PROMPTS, strict=True)]
    seeds = [11, 12, 13]

    def sampled(rows_per_forward: int, multiple: int) -> list[list[int]]:
        decoding = Decoding(
            max_new_tokens=10, temperature=1.0, top_k=0, top_p=1.0, stop_ids=frozenset({7}),
            pad_id=PAD, width=16, rows_per_forward=rows_per_forward, length_multiple=multiple,
        )  # fmt: skip
        return decode_completions(model, prompts, seeds, decoding, torch.device("cpu"), None)

    one_by_one = sampled(1, 1)
    assert sampled(3, 2) == one_by_one
    # The window (16 positions) ends the second row's completion at 7 tokens.
    assert len(one_by_one[1]) <= 16 - PROMPTS[1]
