"""The proof every published family's tests give against transformers' own class: a tiny
random model made by transformers (fixed seed, fp32, norms moved off their constant init
so a mix-up between them shows), imported and compared on unpacked and packed batches,
exported back after a perturbation standing in for training, and decoded greedily with
our key/value cache. Nothing is downloaded: transformers builds the model from its config
class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kempnerforge.config.model import ModelConfig
from kempnerforge.interop.hf import export_hf, import_hf, load_hf_into
from kempnerforge.model.generation.generate import generate
from kempnerforge.model.transformer import Transformer
from tests.support.tolerance import reorder_atol, transformer_terms

SEQ = 24
"""Positions of a test batch: past a tiny window, within the tiny models' 64."""

HF_TINY: dict[str, Any] = dict(
    vocab_size=259,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    max_position_embeddings=64,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=256,
    eos_token_id=257,
    pad_token_id=258,
)
"""A tiny model in transformers' words: 2 key/value heads for 4 query heads, initialised
widely (far from 0, so a wrong mapping shows far above the tolerance)."""


MOVED = {"norm": 0.3}
"""Parameters moved off their constant init by make_hf_folder: a name fragment and the
std of the noise added (norm gains, which start at 1)."""


def make_hf_folder(
    config_cls: type,
    model_cls: type,
    folder: Path,
    moved: dict[str, float] = MOVED,
    **keys: Any,
) -> nn.Module:
    """Build ``model_cls`` from ``config_cls(**HF_TINY, **keys)`` with seed 0, move every
    parameter ``moved`` names off its init (by default the norm gains off 1; a family
    adds its biases, which start at 0), save it to ``folder`` and return it in eval mode."""
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**HF_TINY, **keys})).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            for fragment, std in moved.items():
                if fragment in name:
                    param.add_(std * torch.randn(param.shape, generator=generator))
    model.save_pretrained(folder)
    return model


def imported_model(folder: Path) -> Transformer:
    """Our model with the folder's weights (import_hf's config, load_hf_into's tensors)."""
    found, _ = import_hf(folder)
    model = Transformer(found)
    load_hf_into(model, folder)
    return model.eval()


def logits_atol(cfg: ModelConfig, logits: torch.Tensor, seq_len: int = SEQ) -> float:
    """Largest |ours - theirs| accepted: fp32 sums of the forward's chain in another order,
    at the logits' scale (tests/support/tolerance.py)."""
    terms = transformer_terms(cfg, seq_len, backward=False)
    return reorder_atol(torch.float32, terms, logits.abs().max().item())


def assert_close_logits(ours: torch.Tensor, theirs: torch.Tensor, cfg: ModelConfig) -> None:
    assert theirs.abs().max() > 0.5, "logits too small for the tolerance to mean anything"
    diff = (ours - theirs).abs().max().item()
    assert diff <= logits_atol(cfg, theirs, ours.shape[1]), diff


def random_ids(seed: int = 0, rows: int = 2, seq_len: int = SEQ) -> torch.Tensor:
    return torch.randint(0, 259, (rows, seq_len), generator=torch.Generator().manual_seed(seed))


def assert_unpacked_logits_equal(ours: Transformer, theirs: nn.Module) -> None:
    ids = random_ids()
    with torch.no_grad():
        got, want = ours(ids), theirs(ids).logits
    assert isinstance(got, torch.Tensor)
    assert_close_logits(got, want, ours.cfg)


PACKED_LENGTHS = ((7, 11, 6), (24,), (1, 15, 8))
"""Documents per row of a packed batch (each row SEQ positions): three, one, and one of a
single token."""


def assert_packed_logits_equal(ours: Transformer, theirs: nn.Module) -> None:
    """Rows of several documents each: every document's logits equal transformers' run on
    that document alone (positions restart at each document, as packing's RoPE does)."""
    ids = random_ids(seed=5, rows=len(PACKED_LENGTHS))
    doc_ids = torch.cat(
        [
            torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row))[None]
            for row in PACKED_LENGTHS
        ]
    )
    with torch.no_grad():
        got = ours(ids, doc_ids)
        assert isinstance(got, torch.Tensor)
        for row, lengths in enumerate(PACKED_LENGTHS):
            start = 0
            for length in lengths:
                doc = ids[row : row + 1, start : start + length]
                want = theirs(doc).logits
                assert_close_logits(got[row : row + 1, start : start + length], want, ours.cfg)
                start += length


def perturbed(model: Transformer, seed: int = 7) -> Transformer:
    """``model`` after a stand-in for training: every parameter moved by noise of a tenth
    of its own scale, so the export carries weights transformers never made."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            scale = param.abs().mean().item()
            param.add_(0.1 * scale * torch.randn(param.shape, generator=generator))
    return model


def assert_export_loads_in_transformers(
    model: Transformer, folder: Path, hf_class: str, passed_over: str | None = None
) -> Any:
    """Export ``model`` and load it with transformers' class, every tensor used and none
    missing, but those under ``passed_over`` (a prefix: layers the class does not build,
    which must then be the only ones unused); its logits are ours. Returns the class."""
    import transformers

    export_hf(model, model.cfg, folder, tokenizer_path="byte")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [hf_class]
    cls = getattr(transformers, hf_class)
    theirs, info = cls.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    unused = set(info["unexpected_keys"])
    if passed_over is not None:
        assert unused and all(key.startswith(passed_over) for key in unused), unused
        unused = set()
    for key in ("missing_keys", "mismatched_keys"):
        assert not info[key], (key, info[key])
    assert not unused, unused
    assert_unpacked_logits_equal(model, theirs.eval())
    return theirs


def assert_greedy_generation_equal(ours: Transformer, theirs: Any, new_tokens: int = 12) -> None:
    """Greedy decoding with our key/value cache gives transformers' generate(do_sample=
    False) tokens, past the tiny window where a family has one."""
    prompt = random_ids(seed=3, rows=1, seq_len=9)
    got = generate(ours, prompt[0].tolist(), new_tokens, temperature=0.0)
    with torch.no_grad():
        out = theirs.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=258,
        )
    assert got == out[0, prompt.shape[1] :].tolist()
