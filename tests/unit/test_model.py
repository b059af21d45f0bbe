"""Unit tests for kempnerforge.model: shapes, masking, GQA, RoPE, init, accounting, decoding."""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path

import pytest
import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.model import Transformer, build_model, generate_greedy
from kempnerforge.model.attention.rope import apply_rope, rope_tables
from kempnerforge.model.attention.self_attention import Attention
from kempnerforge.model.mlp import SwiGLU
from kempnerforge.model.moe.layer import MoEFeedForward
from tests.support.tolerance import assert_reordered_close, transformer_terms

PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "model"
VOCAB = 97
SEQ = 24


def tiny_config(**overrides: object) -> ModelConfig:
    fields: dict = dict(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=32
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(**overrides: object) -> Transformer:
    torch.manual_seed(0)
    return Transformer(tiny_config(**overrides))


def random_ids(batch: int = 2, seq_len: int = SEQ, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, seq_len), generator=gen)


def reference_rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Hugging Face Llama style: x * cos + rotate_half(x) * sin, x is (B, H, S, D)."""
    seq_len, head_dim = x.shape[2], x.shape[3]
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.arange(seq_len).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2 :]
    return x * emb.cos() + torch.cat((-x2, x1), dim=-1) * emb.sin()


def reference_attention(attn: Attention, x: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Causal attention with explicit softmax, kv heads repeated by hand."""
    b, s, _ = x.shape
    hd = cfg.head_dim
    q = (x @ attn.wq.weight.T).view(b, s, cfg.n_heads, hd).transpose(1, 2)
    k = (x @ attn.wk.weight.T).view(b, s, cfg.kv_heads, hd).transpose(1, 2)
    v = (x @ attn.wv.weight.T).view(b, s, cfg.kv_heads, hd).transpose(1, 2)
    q, k = reference_rope(q, cfg.rope_theta), reference_rope(k, cfg.rope_theta)
    group = cfg.n_heads // cfg.kv_heads
    k = torch.stack([k[:, h // group] for h in range(cfg.n_heads)], dim=1)
    v = torch.stack([v[:, h // group] for h in range(cfg.n_heads)], dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    future = torch.ones(s, s, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    out = (probs @ v).transpose(1, 2).reshape(b, s, cfg.n_heads * hd)
    return out @ attn.wo.weight.T


def attention_terms(cfg: ModelConfig) -> int:
    """The sizes an attention forward sums in a chain: q/k/v (dim), the rotation (2), the
    scores (head_dim), the softmax and the weighted values (SEQ each), the output (dim)."""
    return cfg.dim + 2 + cfg.head_dim + 2 * SEQ + cfg.dim


def expected_num_params(cfg: ModelConfig) -> int:
    d, hd, hidden = cfg.dim, cfg.head_dim, cfg.hidden_dim
    attention = d * cfg.n_heads * hd * 2 + d * cfg.kv_heads * hd * 2
    block = attention + 3 * d * hidden + 2 * d
    embedding = cfg.vocab_size * d
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * d
    return embedding + cfg.n_layers * block + d + head


def test_forward_returns_logits_of_shape_batch_seq_vocab() -> None:
    model = tiny_model()
    ids = random_ids()
    assert model(ids).shape == (2, SEQ, VOCAB)
    doc_ids = torch.zeros_like(ids)
    assert model(ids, doc_ids).shape == (2, SEQ, VOCAB)


def test_single_document_mask_matches_causal_fast_path() -> None:
    model = tiny_model()
    ids = random_ids()
    # The masked attention kernel and the causal one sum in different orders.
    terms = transformer_terms(model.cfg, SEQ, backward=False)
    assert_reordered_close(model(ids, torch.zeros_like(ids)), model(ids), terms=terms)


@pytest.mark.parametrize("with_doc_ids", [False, True])
def test_changing_a_later_token_never_changes_earlier_logits(with_doc_ids: bool) -> None:
    model = tiny_model()
    ids = random_ids()
    doc_ids = (torch.arange(SEQ) >= 10).long().expand(2, SEQ) if with_doc_ids else None
    changed = ids.clone()
    changed[:, 15] = (changed[:, 15] + 1) % VOCAB
    before, after = model(ids, doc_ids), model(changed, doc_ids)
    # Exact: the same kernels on the same shapes; an earlier row's sums never read a later
    # row except through masked scores, whose zero weights add exact zeros.
    assert torch.equal(before[:, :15], after[:, :15])
    assert not torch.allclose(before[:, 15:], after[:, 15:])


def test_documents_do_not_attend_across_the_boundary() -> None:
    model = tiny_model()
    first_len = 9
    ids = random_ids(batch=1)
    other = ids.clone()
    other[:, :first_len] = random_ids(batch=1, seq_len=first_len, seed=7)
    assert not torch.equal(ids[:, :first_len], other[:, :first_len])
    doc_ids = (torch.arange(SEQ) >= first_len).long()[None]
    # Exact: the same kernels on the same shapes; the second document reads the first
    # only through masked scores, whose zero weights add exact zeros.
    assert torch.equal(model(ids, doc_ids)[:, first_len:], model(other, doc_ids)[:, first_len:])
    assert not torch.allclose(model(ids)[:, first_len:], model(other)[:, first_len:])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_attention_matches_reference_with_kv_heads_repeated_by_hand(n_kv_heads: int) -> None:
    cfg = tiny_config(n_kv_heads=n_kv_heads)
    torch.manual_seed(0)
    attn = Attention(cfg)
    for linear in (attn.wq, attn.wk, attn.wv, attn.wo):
        torch.nn.init.normal_(linear.weight, std=0.1)
    x = torch.randn(2, SEQ, cfg.dim)
    cos, sin = (t[None] for t in rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta))
    expected = reference_attention(attn, x, cfg)
    # The fused attention kernel and the explicit softmax sum in different orders.
    assert_reordered_close(attn(x, cos, sin), expected, terms=attention_terms(cfg))
    one_doc = torch.ones(2, 1, SEQ, SEQ, dtype=torch.bool).tril()
    assert_reordered_close(attn(x, cos, sin, one_doc), expected, terms=attention_terms(cfg))


def test_rope_scores_depend_only_on_relative_position() -> None:
    head_dim = 16
    cos, sin = rope_tables(head_dim, 32, 10000.0)
    q, k = torch.randn(head_dim), torch.randn(head_dim)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        seq = torch.zeros(1, 32, 2, head_dim)
        seq[0, q_pos, 0], seq[0, k_pos, 1] = q, k
        rotated = apply_rope(seq, cos, sin)
        return rotated[0, q_pos, 0] @ rotated[0, k_pos, 1]

    # Other angles, so other roundings: the fp32 angle p * inv_freq is off by up to
    # p * 2**-24 (inv_freq <= 1), up to 20 units at position 20 for each of q and k, on top
    # of the rotation (2 terms) and the dot product (head_dim). A rotated pair's parts are
    # bounded by the sum of the pair's magnitudes.
    pairs_q = q[:8].abs() + q[8:].abs()
    pairs_k = k[:8].abs() + k[8:].abs()
    magnitude = 2 * (pairs_q @ pairs_k)
    assert_reordered_close(
        score(5, 2), score(20, 17), terms=head_dim + 2 + 2 * 20, magnitude=magnitude
    )
    assert not torch.allclose(score(5, 2), score(5, 4))


def test_rope_buffers_are_fp32_and_not_in_state_dict() -> None:
    model = tiny_model()
    assert model.rope_cos.dtype == torch.float32
    assert model.rope_cos.shape == (1, 32, 8)  # one RoPE kind: every layer's
    assert not any("rope" in key for key in model.state_dict())
    assert {"rope_cos", "rope_sin"} <= {name for name, _ in model.named_buffers()}


@pytest.mark.parametrize("tie", [False, True])
def test_meta_then_to_empty_then_init_weights_equals_direct_build(tie: bool) -> None:
    torch.manual_seed(0)
    reference = Transformer(tiny_config(tie_embeddings=tie))
    with torch.device("meta"):
        model = build_model(tiny_config(tie_embeddings=tie))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    assert model.num_params() == reference.num_params()
    # Exact: the same table function and the same seeded init, op for op.
    assert torch.equal(model.rope_cos, reference.rope_cos)
    expected = reference.state_dict()
    for name, param in model.state_dict().items():
        assert torch.equal(param, expected[name]), name


@pytest.mark.parametrize("tie", [False, True])
def test_num_params_equals_formula_from_config(tie: bool) -> None:
    cfg = tiny_config(tie_embeddings=tie, multiple_of=32)
    model = Transformer(cfg)
    assert model.num_params() == expected_num_params(cfg)
    embedding = 0 if tie else cfg.vocab_size * cfg.dim
    assert model.num_params(exclude_embedding=True) == expected_num_params(cfg) - embedding
    assert (model.output.weight is model.tok_embeddings.weight) == tie


@pytest.mark.parametrize("tie", [False, True])
def test_flops_per_token_is_6n_plus_attention_term(tie: bool) -> None:
    cfg = tiny_config(tie_embeddings=tie)
    model = Transformer(cfg)
    n = expected_num_params(cfg) - (0 if tie else cfg.vocab_size * cfg.dim)
    expected = 6 * n + 12 * cfg.n_layers * cfg.dim * 16
    assert model.flops_per_token(16) == pytest.approx(expected)


def test_output_projections_are_initialized_with_depth_scaled_std() -> None:
    cfg = tiny_config(n_kv_heads=4, multiple_of=32, init_std=0.02)
    model = tiny_model(n_kv_heads=4, multiple_of=32, init_std=0.02)
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)
    for layer in model.layers.values():
        assert layer.attention.wo.weight.std().item() == pytest.approx(scaled, rel=0.05)
        assert layer.feed_forward.w2.weight.std().item() == pytest.approx(scaled, rel=0.05)
        assert layer.attention.wq.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)
        assert torch.equal(layer.ffn_norm.weight, torch.ones(cfg.dim))
    assert model.tok_embeddings.weight.std().item() == pytest.approx(cfg.init_std, rel=0.05)


def test_init_is_controlled_by_the_global_seed() -> None:
    first, second = tiny_model(), tiny_model()
    # Exact: the same seed drives the same init ops in the same order.
    for a, b in zip(first.state_dict().values(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_moe_blocks_follow_moe_frequency_and_are_initialized_like_dense_ones() -> None:
    cfg = tiny_config(num_experts=4, moe_frequency=2, moe_shared_experts=1, init_std=0.02)
    model = tiny_model(num_experts=4, moe_frequency=2, moe_shared_experts=1, init_std=0.02)
    dense, moe = model.layers["0"].feed_forward, model.layers["1"].feed_forward
    assert isinstance(dense, SwiGLU)
    assert isinstance(moe, MoEFeedForward)
    assert model.num_params() == cfg.num_params()
    scaled = cfg.init_std / math.sqrt(2 * cfg.n_layers)

    def sample_rel(weight: torch.Tensor) -> float:
        # The std of n normal draws has a relative spread of 1 / sqrt(2 n): 6 of those
        # leaves a seed's draw no chance to fail (256 router weights: 0.27), while an init
        # at another scale (the residual scaling, torch's default) is off by 50% or more.
        return 6 / math.sqrt(2 * weight.numel())

    for weight, std in [
        (moe.experts.w2, scaled),
        (moe.shared.w2.weight, scaled),
        (moe.experts.w1, cfg.init_std),
        (moe.router.gate.weight, cfg.init_std),
    ]:
        assert weight.std().item() == pytest.approx(std, rel=sample_rel(weight))
    logits = model(random_ids())
    assert logits.shape == (2, SEQ, VOCAB)
    assert torch.isfinite(logits).all()
    assert moe.last is not None and moe.last.load.sum().item() == 2 * SEQ * cfg.moe_top_k


def test_generate_greedy_is_deterministic_and_matches_argmax_loop() -> None:
    model = tiny_model(max_seq_len=8)
    prompt = [3, 1, 4, 1, 5]
    tokens = generate_greedy(model, prompt, max_new_tokens=12, max_seq_len=8)
    assert len(tokens) == 12
    assert tokens == generate_greedy(model, prompt, max_new_tokens=12, max_seq_len=8)
    context = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            logits = model.eval()(torch.tensor([context[-8:]]))
            context.append(int(logits[0, -1].argmax()))
    assert tokens == context[len(prompt) :]


def test_generate_greedy_stops_at_stop_id_and_restores_training_mode() -> None:
    model = tiny_model()
    model.train()
    tokens = generate_greedy(model, [7, 8, 9], max_new_tokens=10, max_seq_len=32)
    assert model.training
    stop_id = tokens[4]
    stopped = generate_greedy(model, [7, 8, 9], 10, 32, stop_id=stop_id)
    assert stopped == tokens[: tokens.index(stop_id)]
    model.eval()
    generate_greedy(model, [7, 8, 9], max_new_tokens=2, max_seq_len=32)
    assert not model.training
    assert generate_greedy(model, [7], max_new_tokens=0, max_seq_len=32) == []


@pytest.mark.parametrize("path", sorted(PRESET_DIR.glob("*.toml")), ids=lambda p: p.stem)
def test_preset_loads_and_matches_its_header_param_count(path: Path) -> None:
    text = path.read_text()
    header = re.match(r"# Parameters: ([\d,]+)", text)
    assert header, f"{path.name} must start with '# Parameters: N'"
    stated = int(header.group(1).replace(",", ""))
    cfg = ModelConfig(**tomllib.loads(text)["model"])
    with torch.device("meta"):
        model = Transformer(cfg)
    assert model.num_params() == pytest.approx(stated, rel=0.10)


def test_all_presets_are_present() -> None:
    names = {p.stem for p in PRESET_DIR.glob("*.toml")}
    assert names >= {"debug", "125m", "1b", "8b", "13b", "70b"}


def test_a_document_mask_is_needed_only_where_a_row_holds_two_documents() -> None:
    from kempnerforge.model.attention.self_attention import needs_document_mask

    single = torch.zeros(3, SEQ, dtype=torch.long)
    assert not needs_document_mask(single) and not needs_document_mask(None)
    packed = single.clone()
    packed[1, 10:] = 1
    assert needs_document_mask(packed)


def test_one_document_per_row_gives_the_causal_result_without_a_mask() -> None:
    model = tiny_model()
    ids = random_ids()
    # The masked attention kernel and the causal one sum in different orders.
    terms = transformer_terms(model.cfg, SEQ, backward=False)
    assert_reordered_close(model(ids, torch.zeros_like(ids)), model(ids), terms=terms)


def test_grouped_heads_with_a_document_mask_equal_repeated_heads_on_cpu() -> None:
    cfg = tiny_config()
    assert cfg.kv_heads < cfg.n_heads
    torch.manual_seed(0)
    attn = Attention(cfg)
    x = torch.randn(2, SEQ, cfg.dim)
    doc_ids = (torch.arange(SEQ) >= 9).long().expand(2, SEQ)
    from kempnerforge.model.attention.self_attention import document_causal_mask

    mask = document_causal_mask(doc_ids)
    cos, sin = rope_tables(cfg.head_dim, SEQ, cfg.rope_theta, torch.device("cpu"))
    got = attn(x, cos[None], sin[None], mask)  # one RoPE kind: tables (1, seq, half)
    # The same attention with the key/value heads repeated by hand and an explicit softmax.
    b, s, hd = 2, SEQ, cfg.head_dim
    q = apply_rope(attn.wq(x).view(b, s, -1, hd), cos, sin).transpose(1, 2)
    k = apply_rope(attn.wk(x).view(b, s, -1, hd), cos, sin).transpose(1, 2)
    v = attn.wv(x).view(b, s, -1, hd).transpose(1, 2)
    group = cfg.n_heads // cfg.kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask, float("-inf"))
    want = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1))
    # The grouped attention kernel and the explicit softmax sum in different orders.
    assert_reordered_close(got, want, terms=attention_terms(cfg))
