"""DPO equals TRL's DPOTrainer: on one fixed batch of preference pairs through the same tiny
Llama (a policy and a reference with different weights), our objective's loss, its reward
metrics and the gradient of weights equal what DPOTrainer._compute_loss computes and logs,
for every dpo.loss_type offered. Nothing is downloaded: transformers builds the models from
their config class and the tokenizer is an in-memory word-level vocabulary."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from kempnerforge.config.dpo import DPOConfig
from kempnerforge.config.job import JobConfig
from kempnerforge.model.heads import IGNORE_INDEX, logits_head_loss
from kempnerforge.training.objectives import (
    DPO_METRIC_KEYS,
    REF_LOGPS,
    objective_of,
    reference_logps,
    response_logps,
)
from tests.support.hf_families import HF_TINY, imported_model, make_hf_folder
from tests.support.tolerance import assert_reordered_close, reorder_atol, transformer_terms

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
tokenizers = pytest.importorskip("tokenizers")

PAIRS = 3
SEQ = 20
PROMPT_LENS = (4, 7, 5)
"""Each pair's prompt length; its chosen and rejected responses have other lengths, and a
row ends in right padding that neither side may count."""
RESPONSE_LENS = ((9, 5), (6, 11), (13, 3))

GRADIENTS = {
    "output.weight": "lm_head.weight",
    "layers.0.feed_forward.w2.weight": "model.layers.0.mlp.down_proj.weight",
    "tok_embeddings.weight": "model.embed_tokens.weight",
}
"""Weights whose gradients are compared: ours and transformers' names (none is permuted)."""

VARIANTS = [
    pytest.param(DPOConfig(beta=0.1), "sigmoid", {}, id="sigmoid"),
    # cDPO: TRL 1.16's sigmoid has no smoothing; its "aot" loss is the cDPO formula on the
    # sorted log-ratio differences, which for one pair is the pair's own (PAIRS = 1 then).
    pytest.param(DPOConfig(beta=0.5, label_smoothing=0.2), "aot", {"label_smoothing": 0.2},
                 id="cdpo"),
    pytest.param(DPOConfig(beta=0.3, loss_type="robust", label_smoothing=0.1), "robust",
                 {"label_smoothing": 0.1}, id="robust"),
    pytest.param(DPOConfig(beta=0.1, loss_type="ipo"), "ipo", {}, id="ipo"),
    pytest.param(DPOConfig(beta=2.0, loss_type="hinge"), "hinge", {}, id="hinge"),
]  # fmt: skip


def _pair_batch(pairs: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and completion_mask as TRL's collator gives them (rows
    [0, pairs) chosen, [pairs, 2 * pairs) rejected, right-padded), random tokens."""
    generator = torch.Generator().manual_seed(3)
    rows = 2 * pairs
    ids = torch.full((rows, SEQ), HF_TINY["pad_token_id"])
    attention = torch.zeros(rows, SEQ, dtype=torch.long)
    completion = torch.zeros(rows, SEQ, dtype=torch.long)
    prompts = [torch.randint(0, 256, (n,), generator=generator) for n in PROMPT_LENS]
    for side in (0, 1):
        for pair in range(pairs):
            row, prompt = side * pairs + pair, prompts[pair]
            response = torch.randint(0, 256, (RESPONSE_LENS[pair][side],), generator=generator)
            length = len(prompt) + len(response)
            ids[row, :length] = torch.cat([prompt, response])
            attention[row, :length] = 1
            completion[row, len(prompt) : length] = 1
    return {"input_ids": ids, "attention_mask": attention, "completion_mask": completion}


def _our_labels(trl_batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Our labels for the same rows: position t predicts token t + 1, supervised where that
    token is a response token (the loader's labels from token_flags)."""
    ids, completion = trl_batch["input_ids"], trl_batch["completion_mask"]
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = torch.where(completion[:, 1:].bool(), ids[:, 1:], IGNORE_INDEX)
    return labels


def _word_tokenizer():
    """An in-memory word-level tokenizer over the tiny model's ids (t0 .. t258)."""
    vocab = {f"t{i}": i for i in range(HF_TINY["vocab_size"])}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t0")),
        bos_token="t256",
        eos_token="t257",
        pad_token="t258",
    )


def _placeholder_pairs():
    """The train_dataset a trainer is built with; the tests pass their batch directly."""
    return datasets.Dataset.from_list([{"prompt": "t1 t2", "chosen": " t3", "rejected": " t4"}] * 2)


def _trainer(policy, reference, cfg: DPOConfig, loss_type: str, extra: dict, tmp_path: Path):
    """DPOTrainer over the HF policy and reference, offline, on CPU, logging nowhere."""
    args = trl.DPOConfig(
        output_dir=str(tmp_path / "trl"),
        report_to=[],
        use_cpu=True,
        bf16=False,
        beta=cfg.beta,
        loss_type=[loss_type],
        **extra,
    )
    return trl.DPOTrainer(
        model=policy,
        ref_model=reference,
        args=args,
        train_dataset=_placeholder_pairs(),
        processing_class=_word_tokenizer(),
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(HF policy, HF reference, our policy, our reference): the reference is a tiny random
    Llama, the policy the same after a perturbation standing in for SFT."""
    root = tmp_path_factory.mktemp("dpo_models")
    cls, config_cls = transformers.LlamaForCausalLM, transformers.LlamaConfig
    hf_reference = make_hf_folder(config_cls, cls, root / "reference")
    hf_policy = copy.deepcopy(hf_reference)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in hf_policy.parameters():
            scale = param.abs().mean().item()
            param.add_(0.3 * scale * torch.randn(param.shape, generator=generator))
    hf_policy.save_pretrained(root / "policy")  # pyright: ignore[reportCallIssue]
    ours_policy = imported_model(root / "policy")
    ours_reference = imported_model(root / "reference")
    return hf_policy, hf_reference, ours_policy, ours_reference


@pytest.mark.parametrize(("cfg", "trl_loss", "extra"), VARIANTS)
def test_dpo_loss_rewards_and_gradients_equal_trl(models, cfg, trl_loss, extra, tmp_path):
    hf_policy, hf_reference, ours_policy, ours_reference = (copy.deepcopy(m) for m in models)
    pairs = 1 if trl_loss == "aot" else PAIRS
    trl_batch = _pair_batch(pairs)

    trainer = _trainer(hf_policy, hf_reference, cfg, trl_loss, extra, tmp_path)
    trainer.model.train()
    trainer.model.zero_grad()
    want = trainer._compute_loss(trainer.model, trl_batch, False)
    want.backward()
    want = want.detach()
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items()}
    hf_params = dict(trainer.model.named_parameters())

    job = JobConfig()
    job.train.loss_fn, job.dpo = "dpo", cfg
    objective = objective_of(job)
    labels = _our_labels(trl_batch)
    batch = {"input_ids": trl_batch["input_ids"], "labels": labels}
    batch[REF_LOGPS] = reference_logps(ours_reference, batch, torch.device("cpu"))
    ours_policy.train()
    ours_policy.zero_grad()
    head = logits_head_loss(ours_policy(batch["input_ids"]), labels, 0.0, per_token_grad=True)
    got = objective.loss(head, batch) / objective.count(batch)
    got.backward()
    assert objective.count(batch) == pairs and objective.metrics_row is not None
    assert objective.metric_sums is not None
    row = objective.metrics_row(objective.metric_sums(head, batch).tolist())

    # A log-probability sums SEQ per-token log-softmaxes, each at the end of the forward's
    # chain of sums; the loss and rewards are Lipschitz in the four log-probabilities of a
    # pair, with at most the constant below (d loss / d log-ratio).
    cfg_model = ours_policy.cfg
    terms = transformer_terms(cfg_model, SEQ, backward=False) + SEQ + 2 * pairs
    logps = response_logps(head.token_losses).detach()
    magnitude = 2 * float(logps.abs().max() + batch[REF_LOGPS].abs().max())
    logp_atol = reorder_atol(torch.float32, terms, magnitude)
    lipschitz = {
        "sigmoid": cfg.beta,
        "aot": cfg.beta,
        "hinge": cfg.beta,
        "robust": cfg.beta / (1 - 2 * cfg.label_smoothing),
        "ipo": 2 * (abs(float(want)) ** 0.5 + logp_atol) + 1.0,
    }[trl_loss]
    assert float(want) > 1e-3, "a loss of 0 would leave nothing to compare"
    assert abs(float(got) - float(want)) <= lipschitz * logp_atol

    # Rewards: beta times differences of log-probabilities; accuracies are the same unless
    # a pair's margin lies within the bound.
    for key in ("logps/chosen", "logps/rejected"):
        assert abs(row[key] - logged[key]) <= logp_atol, key
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(row[key] - logged[key]) <= cfg.beta * 2 * logp_atol, key
    # TRL's is a float32 mean of 0s and 1s: one rounding of a value in [0, 1].
    assert abs(row["rewards/accuracies"] - logged["rewards/accuracies"]) <= 2**-24
    assert set(DPO_METRIC_KEYS) <= set(logged)
    assert abs(logged["rewards/margins"]) > 10 * cfg.beta * logp_atol, "rewards too close"

    # Gradients: the same chain forward and back, then the sums over pairs and tokens.
    grad_terms = transformer_terms(cfg_model, SEQ) + SEQ + 2 * pairs
    _assert_gradients_equal(ours_policy, hf_params, grad_terms)


def _cpo_trainer(policy, cfg: DPOConfig, tmp_path: Path):
    """TRL's CPOTrainer computing SimPO (cpo_alpha 0: no NLL term), offline, on CPU."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    args = CPOConfig(
        output_dir=str(tmp_path / "trl"), report_to=[], use_cpu=True, bf16=False,
        beta=cfg.beta, loss_type="simpo", simpo_gamma=cfg.simpo_gamma, cpo_alpha=0.0,
        label_smoothing=cfg.label_smoothing,
    )  # fmt: skip
    return CPOTrainer(
        model=policy, args=args, train_dataset=_placeholder_pairs(),
        processing_class=_word_tokenizer(),
    )  # fmt: skip


def _cpo_batch(trl_batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The same pairs in CPO's layout: chosen and rejected rows apart, labels the row's
    tokens where they are response tokens (-100 elsewhere), unshifted."""
    rows = trl_batch["input_ids"].shape[0] // 2
    labels = torch.where(trl_batch["completion_mask"].bool(), trl_batch["input_ids"], -100)
    out = {}
    for side, part in (("chosen", slice(0, rows)), ("rejected", slice(rows, 2 * rows))):
        out[f"{side}_input_ids"] = trl_batch["input_ids"][part]
        out[f"{side}_attention_mask"] = trl_batch["attention_mask"][part]
        out[f"{side}_labels"] = labels[part]
    return out


@pytest.mark.parametrize(
    "cfg",
    [DPOConfig(beta=2.0, loss_type="simpo", simpo_gamma=0.5),
     DPOConfig(beta=2.5, loss_type="simpo", simpo_gamma=1.2, label_smoothing=0.1)],
    ids=["simpo", "simpo-smoothed"],
)  # fmt: skip
def test_simpo_loss_rewards_and_gradients_equal_trl_cpo(models, cfg, tmp_path):
    """SimPO (dpo.loss_type = "simpo") equals TRL's CPOTrainer with loss_type "simpo" and
    cpo_alpha 0: each response's mean log-probability per token, no reference."""
    hf_policy, _, ours_policy, _ = (copy.deepcopy(m) for m in models)
    trl_batch = _pair_batch(PAIRS)
    trainer = _cpo_trainer(hf_policy, cfg, tmp_path)
    trainer.model.train()
    trainer.model.zero_grad()
    want, logged = trainer.get_batch_loss_metrics(trainer.model, _cpo_batch(trl_batch))
    want.backward()
    want = want.detach()
    hf_params = dict(trainer.model.named_parameters())

    job = JobConfig()
    job.train.loss_fn, job.dpo = "dpo", cfg
    objective = objective_of(job)
    assert REF_LOGPS not in objective.batch_keys  # no reference is built or read
    labels = _our_labels(trl_batch)
    batch = {"input_ids": trl_batch["input_ids"], "labels": labels}
    ours_policy.train()
    ours_policy.zero_grad()
    head = logits_head_loss(ours_policy(batch["input_ids"]), labels, 0.0, per_token_grad=True)
    got = objective.loss(head, batch) / objective.count(batch)
    got.backward()
    assert objective.metrics_row is not None and objective.metric_sums is not None
    row = objective.metrics_row(objective.metric_sums(head, batch).tolist())

    # A mean log-probability: a sum of at most SEQ log-softmaxes divided by the token count,
    # so its error is the sum's bound over at least one token; the loss is beta-Lipschitz in
    # each of the pair's two means.
    terms = transformer_terms(ours_policy.cfg, SEQ, backward=False) + SEQ + 2 * PAIRS
    magnitude = 2 * float(response_logps(head.token_losses).detach().abs().max())
    logp_atol = reorder_atol(torch.float32, terms, magnitude)
    assert float(want) > 1e-3
    assert abs(float(got) - float(want)) <= 2 * cfg.beta * logp_atol
    for key in ("logps/chosen", "logps/rejected"):
        assert abs(row[key] - logged[key]) <= logp_atol, key
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(row[key] - logged[key]) <= cfg.beta * 2 * logp_atol, key
    assert abs(row["rewards/accuracies"] - logged["rewards/accuracies"]) <= 2**-24
    assert abs(logged["rewards/margins"]) > 10 * cfg.beta * logp_atol, "rewards too close"

    grad_terms = transformer_terms(ours_policy.cfg, SEQ) + SEQ + 2 * PAIRS
    _assert_gradients_equal(ours_policy, hf_params, grad_terms)


def _assert_gradients_equal(ours_policy, hf_params: dict, grad_terms: int) -> None:
    """GRADIENTS' weights: ours equal transformers' within ``grad_terms`` reordered sums,
    and TRL's are not zero."""
    ours = dict(ours_policy.named_parameters())
    for our_name, hf_name in GRADIENTS.items():
        got_grad, want_grad = ours[our_name].grad, hf_params[hf_name].grad
        assert got_grad is not None and want_grad is not None
        assert want_grad.abs().max() > 0, our_name
        assert_reordered_close(got_grad, want_grad, terms=grad_terms)
