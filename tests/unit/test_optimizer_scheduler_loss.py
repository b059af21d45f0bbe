"""Optimizer parameter groups, scheduler formulas, and the summed loss functions."""

from __future__ import annotations

import math

import pytest
import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.config.scheduler import SchedulerConfig
from kempnerforge.config.train import TrainConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model import build_model
from kempnerforge.optim.optimizer import build_optimizer, param_groups
from kempnerforge.optim.scheduler import build_scheduler, lr_factor
from kempnerforge.training.loss import (
    IGNORE_INDEX,
    TokenCrossEntropy,
    build_loss_fn,
    cross_entropy_sum,
)
from tests.support.tolerance import reorder_atol

TINY = ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16, multiple_of=16)


def test_param_groups_exclude_norms_biases_and_embeddings_from_decay():
    model = build_model(TINY)
    decay, no_decay = param_groups(model, OptimizerConfig(weight_decay=0.1))
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    decayed = {id(p) for p in decay["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert all(
        names[i].endswith(
            (
                "wq.weight",
                "wk.weight",
                "wv.weight",
                "wo.weight",
                "w1.weight",
                "w2.weight",
                "w3.weight",
                "output.weight",
            )
        )
        for i in decayed
    )
    assert id(model.tok_embeddings.weight) not in decayed
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == model.num_params()


def test_param_group_switches_and_tied_weight_counted_once():
    tied = build_model(ModelConfig(**{**TINY.__dict__, "tie_embeddings": True}))
    groups = param_groups(tied, OptimizerConfig(decay_embeddings=True, decay_norms_and_biases=True))
    assert len(groups) == 1
    assert sum(p.numel() for p in groups[0]["params"]) == tied.num_params()


def test_the_experts_stacked_biases_are_biases_for_decay_and_for_muon():
    """GPT-OSS's expert biases are (experts, width): 2-D, yet biases. They do not decay by
    default, and Muon leaves them to AdamW instead of orthogonalising them as matrices."""
    cfg = ModelConfig(
        **{**TINY.__dict__, "num_experts": 4, "moe_top_k": 2, "moe_expert_bias": True}
    )
    model = build_model(cfg)
    names = {id(p): n for n, p in model.named_parameters()}
    biases = [n for n in names.values() if n.endswith(("experts.b1", "experts.b2", "experts.b3"))]
    assert biases and all(model.get_parameter(n).ndim == 2 for n in biases)
    decay, no_decay = param_groups(model, OptimizerConfig(weight_decay=0.1))
    assert set(biases) <= {names[id(p)] for p in no_decay["params"]}
    for decay_biases in (False, True):
        config = OptimizerConfig(name="muon", decay_norms_and_biases=decay_biases)
        muon = build_optimizer(model, config)
        orthogonalised = {
            names[id(p)] for g in muon.param_groups if g["use_muon"] for p in g["params"]
        }
        assert orthogonalised and not orthogonalised & set(biases)
        assert any(n.endswith("experts.w1") for n in orthogonalised)


def test_adamw_is_built_and_unknown_name_lists_choices():
    model = build_model(TINY)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3, betas=[0.8, 0.9]))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.8, 0.9)
    with pytest.raises(ConfigError, match="optimizer.name = 'adam': expected one of adamw"):
        build_optimizer(model, OptimizerConfig(name="adam"))


@pytest.mark.parametrize(
    ("name", "step", "expected"),
    [
        ("cosine", 0, 0.1),  # warmup: (0 + 1) / 10
        ("cosine", 9, 1.0),
        ("cosine", 10, 1.0),  # progress 0
        ("cosine", 55, 0.2 + 0.8 * 0.5),  # progress 0.5
        ("cosine", 100, 0.2),
        ("linear", 55, 1 - 0.8 * 0.5),
        ("linear", 100, 0.2),
        ("constant", 77, 1.0),
        ("wsd", 50, 1.0),  # stable until progress 0.8 (step 82)
        ("wsd", 82, 1.0),
        ("wsd", 91, 1 - 0.8 * 0.5),
        ("wsd", 100, 0.2),
        ("rex", 0, 0.1),  # the same warmup
        ("rex", 10, 1.0),  # progress 0
        ("rex", 55, 0.2 + 0.8 * 0.5 / 0.75),  # progress 0.5: (1 - p) / (1 - p/2) = 2/3
        ("rex", 82, 0.2 + 0.8 * 0.2 / 0.6),  # progress 0.8
        ("rex", 100, 0.2),
        ("none", 0, 1.0),  # no warmup either
        ("none", 5, 1.0),
        ("none", 100, 1.0),
    ],
)
def test_lr_factor_formulas(name, step, expected):
    cfg = SchedulerConfig(name=name, warmup_steps=10, min_lr_ratio=0.2, wsd_decay_fraction=0.2)
    assert lr_factor(step, cfg, max_steps=100) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("decay_type", "step", "expected"),
    [
        ("linear", 90, 0.2 + 0.8 * 0.5),  # no warmup: the decay runs over steps 80..100
        ("cosine", 80, 1.0),
        ("cosine", 85, 0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.25))),
        ("cosine", 90, 0.2 + 0.8 * 0.5),  # cos(pi/2) = 0
        ("cosine", 100, 0.2),
        ("sqrt", 80, 1.0),
        ("sqrt", 85, 0.2 + 0.8 * 0.5),  # decay progress 0.25: 1 - sqrt(0.25)
        ("sqrt", 90, 0.2 + 0.8 * (1 - math.sqrt(0.5))),
        ("sqrt", 100, 0.2),
    ],
)
def test_wsd_decay_types(decay_type, step, expected):
    cfg = SchedulerConfig(
        name="wsd",
        warmup_steps=0,
        min_lr_ratio=0.2,
        wsd_decay_fraction=0.2,
        wsd_decay_type=decay_type,
    )
    assert lr_factor(step, cfg, max_steps=100) == pytest.approx(expected)


def test_wsd_decay_type_is_checked():
    with pytest.raises(ConfigError, match="scheduler.wsd_decay_type = 'exp': expected one of"):
        SchedulerConfig(wsd_decay_type="exp")


@pytest.mark.parametrize(
    "cfg",
    [
        SchedulerConfig(warmup_steps=5),
        SchedulerConfig(name="rex", warmup_steps=5),
        SchedulerConfig(name="none"),
        SchedulerConfig(name="wsd", warmup_steps=5, wsd_decay_type="cosine"),
        SchedulerConfig(name="wsd", warmup_steps=5, wsd_decay_type="sqrt"),
    ],
    ids=["cosine", "rex", "none", "wsd-cosine", "wsd-sqrt"],
)
def test_scheduler_state_dict_round_trip_continues_identically(cfg):
    def make():
        model = torch.nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        return opt, build_scheduler(opt, cfg, max_steps=50)

    opt, sched = make()
    for _ in range(12):
        opt.step()
        sched.step()
    opt2, sched2 = make()
    sched2.load_state_dict(sched.state_dict())
    for _ in range(10):
        opt.step()
        sched.step()
        opt2.step()
        sched2.step()
        assert sched.get_last_lr() == sched2.get_last_lr()
        assert sched.get_last_lr() == [lr_factor(sched.last_epoch, cfg, max_steps=50)]
    assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]


def test_scheduler_first_step_trains_and_unknown_name_fails_at_build():
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    sched = build_scheduler(opt, SchedulerConfig(warmup_steps=4), max_steps=10)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.25)
    assert sched.get_last_lr() == [pytest.approx(0.25)]
    with pytest.raises(ConfigError, match="scheduler.name"):
        build_scheduler(opt, SchedulerConfig(name="cosin"), max_steps=10)


@pytest.mark.parametrize("name", ["cosine", "linear", "wsd", "rex", "constant"])
def test_warmup_longer_than_the_run_is_cut_to_the_run(name):
    # warmup_steps = 20 on a 5-step run: the warmup spans the run and peaks at its last step.
    cfg = SchedulerConfig(name=name, warmup_steps=20, min_lr_ratio=0.1)
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=2.0)
    sched = build_scheduler(opt, cfg, max_steps=5)
    lrs = []
    for _ in range(5):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.4, 0.8, 1.2, 1.6, 2.0])


def test_warmup_equal_to_the_run_is_unchanged():
    cfg = SchedulerConfig(warmup_steps=5)
    assert [lr_factor(s, cfg, max_steps=5) for s in range(5)] == pytest.approx(
        [0.2, 0.4, 0.6, 0.8, 1.0]
    )
    long = SchedulerConfig(warmup_steps=4)
    assert [lr_factor(s, long, max_steps=100) for s in range(5)] == pytest.approx(
        [0.25, 0.5, 0.75, 1.0, 1.0]
    )


def test_cross_entropy_sum_ignores_masked_labels():
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, IGNORE_INDEX, 2], [IGNORE_INDEX, IGNORE_INDEX, 4]])
    expected = sum(
        -torch.log_softmax(logits[b, s], -1)[labels[b, s]]
        for b in range(2)
        for s in range(3)
        if labels[b, s] != IGNORE_INDEX
    )
    # Fused against per-token log_softmax: 5 logits in each logsumexp, 3 tokens summed.
    atol = reorder_atol(torch.float32, 5 + 3, float(expected))
    assert cross_entropy_sum(logits, labels) == pytest.approx(float(expected), rel=0, abs=atol)
    assert build_loss_fn(TrainConfig()) == TokenCrossEntropy(0.0)


def test_z_loss_adds_weighted_logsumexp_squared_of_supervised_tokens():
    logits = torch.randn(1, 4, 6)
    labels = torch.tensor([[0, 1, IGNORE_INDEX, 3]])
    loss_fn = build_loss_fn(TrainConfig(z_loss_weight=0.1))
    log_z = torch.logsumexp(logits[0], -1)
    z_term = 0.1 * float(sum(log_z[i] ** 2 for i in (0, 1, 3)))
    expected = float(cross_entropy_sum(logits, labels)) + z_term
    # 6 logits in each logsumexp, 3 tokens summed twice (the loss and the z term).
    atol = reorder_atol(torch.float32, 6 + 3 + 3, expected)
    assert float(loss_fn(logits, labels)) == pytest.approx(expected, rel=0, abs=atol)
    assert math.isfinite(expected)
