"""Multi-token prediction (model.mtp_depth): the module against the DeepSeek-V3 report's
equations written out here, its targets in packed rows, its parameters, its place in the
training objective and metrics, and the layouts it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.data.dataset import IGNORE_INDEX
from kempnerforge.distributed.blocks import transformer_blocks
from kempnerforge.model.mtp import mtp_targets
from kempnerforge.model.transformer import Transformer
from kempnerforge.training.loop import run_training_loop, text_step
from kempnerforge.training.resume_plan import resume_session
from tests.support.metrics_rows import read_rows
from tests.support.tolerance import assert_reordered_close, transformer_terms
from tests.unit.test_loop import StopAfter, batches_of, make_session

DENSE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=64)
MOE = dict(DENSE, num_experts=4, moe_top_k=2, moe_shared_experts=1, moe_expert_hidden_dim=16)


def _model(depth: int = 2, **shape) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**{**DENSE, **shape}, mtp_depth=depth)).eval()
    with torch.no_grad():  # norm gains off 1, so a norm applied to the wrong input shows
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn(param.shape))
    return model


# --- the report's equations, written out ----------------------------------------------


def _rms(x: torch.Tensor, gain: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gain


def reference_losses(model: Transformer, document: torch.Tensor) -> list[torch.Tensor]:
    """Summed cross-entropy of each depth over one document (1, L) alone, as the report
    writes it: h'_i = M_k [RMSNorm(h^{k-1}_i) ; RMSNorm(Emb(t_{i+k}))] (DeepSeek's code and
    transformers put the embedding first), h^k = TRM_k(h'_{1:T-k}) over the truncated
    sequence, P^k_{i+k+1} = OutHead(h^k_i), with the decoder's embedding and head. The
    hidden state passed on is the one the head reads, after its norm (the decoder's final
    norm for h^0, the module's head norm after), as transformers' MtpModel passes it.

    Only the decoder's trunk (h^0) and each module's block (TRM_k) are the model's own
    calls: both are compared with transformers elsewhere; everything MTP adds is here."""
    cfg = model.cfg
    length = document.shape[1]
    emb, head = model.tok_embeddings.weight, model.output.weight  # type: ignore[union-attr]
    trunk = model.run_layers(model.embed(document), *model.rope(length))
    hidden = _rms(trunk, model.norm.weight, cfg.norm_eps)  # type: ignore[union-attr]
    losses = []
    for k, module in enumerate(model.mtp or [], start=1):
        n = length - k - 1  # positions whose token k + 1 ahead is in the document
        ahead = emb[document[0, k : k + n]][None]
        joined = torch.cat(
            [
                _rms(ahead, module.enorm.weight, cfg.norm_eps),
                _rms(hidden[:, :n], module.hnorm.weight, cfg.norm_eps),
            ],
            dim=-1,
        )
        out = module.block(joined @ module.eh_proj.weight.T, *model.rope(n))
        hidden = _rms(out, module.norm.weight, cfg.norm_eps)
        logits = hidden @ head.T
        targets = document[0, k + 1 : k + 1 + n]
        losses.append(F.cross_entropy(logits[0], targets, reduction="sum"))
    return losses


def _packed(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, doc_ids) of one packed row of documents of ``lengths``: each
    position's label is the next token of its document, IGNORE_INDEX at a document's end
    (as the data pipeline masks a label that opens another document)."""
    ids = torch.randint(0, 259, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    labels = torch.roll(ids, -1, dims=1)
    labels[0, torch.cumsum(torch.tensor(lengths), 0) - 1] = IGNORE_INDEX
    return ids, labels, doc_ids


def _assert_sums_close(got: torch.Tensor, want: list[torch.Tensor], model: Transformer, n: int):
    # The chain of the decoder and every module's block (transformer_terms counts them),
    # then up to n per-position losses summed in another order.
    terms = transformer_terms(model.cfg, n, backward=False) + n
    assert_reordered_close(got, torch.stack(want), terms=terms, magnitude=sum(want).item())


@pytest.mark.parametrize("shape", [{}, MOE], ids=["dense", "moe"])
def test_the_modules_compute_the_reports_equations(shape):
    model = _model(**shape)
    ids, labels, _ = _packed([24])
    with torch.no_grad():
        model(ids, labels=labels, mtp_targets=mtp_targets(labels, None, 2))
        assert model.mtp is not None and model.mtp.last is not None
        sums, counts = model.mtp.last
        want = reference_losses(model, ids)
    assert counts.tolist() == [22, 21]
    _assert_sums_close(sums, want, model, 24)


def test_no_target_is_taken_from_another_document():
    """A packed row's losses are the sums of each document's alone: nothing is predicted
    across a boundary, whatever attention sees."""
    lengths = [7, 11, 6]
    model = _model()
    ids, labels, doc_ids = _packed(lengths, seed=3)
    with torch.no_grad():
        model(ids, doc_ids, mtp_targets=mtp_targets(labels, doc_ids, 2))
        assert model.mtp is not None and model.mtp.last is not None
        sums, counts = model.mtp.last
        spans = zip([0, 7, 18], lengths, strict=True)
        per_doc = [reference_losses(model, ids[:, s : s + n]) for s, n in spans]
    assert counts.tolist() == [sum(n - 2 for n in lengths), sum(n - 3 for n in lengths)]
    want = [sum(doc[k] for doc in per_doc) for k in range(2)]
    _assert_sums_close(sums, want, model, 24)


def test_targets_shift_by_depth_and_stop_at_ignored_labels_and_documents():
    labels = torch.tensor([[10, 11, IGNORE_INDEX, 13, 14, 15]])
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1]])
    got = mtp_targets(labels, doc_ids, 2)
    x = IGNORE_INDEX
    assert got.tolist() == [[[11, x, x, 14, 15, x]], [[x, x, x, 15, x, x]]]
    assert mtp_targets(labels, None, 1).tolist() == [[[11, x, 13, 14, 15, x]]]


# --- parameters and cost -----------------------------------------------------------------


@pytest.mark.parametrize("shape", [{}, {"tie_embeddings": True}, MOE], ids=["dense", "tied", "moe"])
def test_parameters_are_counted_and_the_embedding_and_head_are_shared(shape):
    cfg = ModelConfig(**{**DENSE, **shape}, mtp_depth=2)
    model = Transformer(cfg)
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    without = dataclasses.replace(cfg, mtp_depth=0)
    per_module = (cfg.num_params() - without.num_params()) // 2
    block = without.num_params() - dataclasses.replace(without, n_layers=1).num_params()
    assert per_module == block + 2 * 32 * 32 + 3 * 32  # eh_proj, enorm, hnorm, head norm
    names = [n for n, _ in model.named_parameters() if n.startswith("mtp.")]
    assert not [n for n in names if "embed" in n or "output" in n]


def test_off_costs_nothing_and_a_forward_without_targets_skips_the_modules():
    plain = Transformer(ModelConfig(**DENSE))
    assert plain.mtp is None and plain.training_head_blocks() == []
    model = _model()
    ids = torch.randint(0, 259, (1, 16))
    with torch.no_grad():
        model(ids)
    assert model.mtp is not None and model.mtp.last is None
    assert [i for i, _ in transformer_blocks(model)] == [0, 1, 2, 3]


# --- configuration -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["--distributed.pp=2", "--train.grad_accum_steps=2"], "distributed.pp"),
        (["--distributed.cp=2"], "distributed.cp"),
        (["--distributed.tp=2"], "distributed.tp"),
        (["--train.seq_len=3"], "model.mtp_depth"),
    ],
    ids=["pipeline", "context", "tensor", "too-short"],
)
def test_layouts_that_cannot_carry_the_modules_are_refused(overrides, field):
    base = ["--model.mtp_depth=2", "--model.n_heads=4", "--model.n_kv_heads=2"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, *overrides]).validate(2)
    assert info.value.field == field
    if field.startswith("distributed."):
        assert "expected 1 with multi-token prediction (model.mtp_depth = 2)" in str(info.value)


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"mtp_depth": -1}, "model.mtp_depth"), ({"mtp_loss_weight": -0.1}, "model.mtp_loss_weight")],
)
def test_fields_out_of_range_are_refused(changes, field):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**changes)
    assert info.value.field == field


# --- training ------------------------------------------------------------------------------


MTP = ["--model.mtp_depth=1", "--model.mtp_loss_weight=0.3"]


def test_the_step_adds_the_weighted_loss_to_the_objective_not_to_the_reported_loss(
    tiny_overrides,
):
    """text_step's gradient is that of (CE + lambda / D * sum_k CE_k) / supervised tokens,
    computed here from the model's forward; its reported loss is the CE alone."""
    session = make_session(
        tiny_overrides + MTP + ["--model.mtp_depth=2", "--train.grad_clip_norm=0"]
    )
    model = session.model
    batch = batches_of(session.data.dataloader, 1)[0]
    session.data.dataloader = [batch]
    doc_ids, labels = batch["doc_ids"], batch["labels"]
    logits = model(batch["input_ids"], doc_ids, mtp_targets=mtp_targets(labels, doc_ids, 2))
    main = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    sums, _ = model.mtp.last
    tokens = (labels != IGNORE_INDEX).sum()
    ((main + 0.3 / 2 * sums.sum()) / tokens).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.mtp.last = None
    result = text_step(session, 0)
    assert result.loss == pytest.approx((main / tokens).item(), rel=1e-5)
    terms = transformer_terms(session.config.model, 32) + int(tokens)
    for name, param in model.named_parameters():
        assert_reordered_close(param.grad, want[name], terms=terms)
    assert want["mtp.1.eh_proj.weight"].abs().sum() > 0


def test_a_run_learns_and_logs_the_mtp_loss(tiny_overrides):
    session = make_session(tiny_overrides + MTP + ["--train.max_steps=30", "--optimizer.lr=3e-3"])
    with session.tracker:
        run_training_loop(session)
    rows = [r for r in read_rows(session.config.run_dir) if "loss" in r and "event" not in r]
    losses, mtp = [r["loss"] for r in rows], [r["mtp/loss"] for r in rows]
    assert len(mtp) == 30 and "mtp/loss_by_depth" not in rows[0]
    assert sum(losses[-5:]) < 0.7 * sum(losses[:5])
    assert sum(mtp[-5:]) < 0.7 * sum(mtp[:5])


def test_resume_continues_bitwise_equal_with_the_modules(tiny_overrides):
    run = tiny_overrides + MTP + ["--train.deterministic=true", "--train.max_steps=5"]
    full = make_session(run)
    with full.tracker:
        run_training_loop(full)
    want = [(r["loss"], r["mtp/loss"]) for r in read_rows(full.config.run_dir) if "loss" in r]
    split = [o for o in run if not o.startswith("--train.run_dir")]
    split += [f"--train.run_dir={full.config.run_dir}-split"]
    first = make_session([*split, "--checkpoint.interval=2"])
    first.hooks.add(StopAfter(first, 2))
    with first.tracker:
        run_training_loop(first)
    second = make_session(split)
    with second.tracker:
        step, tokens = resume_session(second)
        assert step == 2
        run_training_loop(second, step=step, tokens_seen=tokens)
    got = [(r["loss"], r["mtp/loss"]) for r in read_rows(second.config.run_dir) if "loss" in r]
    assert got == want
