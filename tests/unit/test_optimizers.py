"""Lion, Muon and schedule-free AdamW beside AdamW: they train, resume bitwise, and keep
their own contracts (Newton-Schulz spectrum, Muon's split, schedule-free's eval point)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kempnerforge.config.loader import load_config
from kempnerforge.config.model import ModelConfig
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.config.scheduler import SchedulerConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model import build_model
from kempnerforge.optim.muon import Muon, newton_schulz_orthogonalize
from kempnerforge.optim.optimizer import (
    build_optimizer,
    optimizer_eval_mode,
    set_optimizer_mode,
)
from kempnerforge.optim.schedule_free import ScheduleFreeAdamW
from kempnerforge.optim.scheduler import build_scheduler
from kempnerforge.training.loss import cross_entropy_sum

TINY = ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16, multiple_of=16)
NAMES = ["adamw", "lion", "muon", "schedule_free_adamw"]
CONFIGS = {
    "adamw": OptimizerConfig(lr=3e-3, implementation="for_loop"),
    "lion": OptimizerConfig(lr=2e-3, betas=[0.9, 0.99]),
    "muon": OptimizerConfig(name="muon", lr=0.02, muon_adam_lr=3e-3),
    "schedule_free_adamw": OptimizerConfig(
        lr=3e-3, betas=[0.9, 0.999], schedule_free_warmup_steps=5
    ),
}


def _config(name: str) -> OptimizerConfig:
    return OptimizerConfig(**{**CONFIGS[name].__dict__, "name": name})


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed classification task: map 4 random sequences to random next tokens."""
    gen = torch.Generator().manual_seed(0)
    inputs = torch.randint(0, TINY.vocab_size, (4, TINY.max_seq_len), generator=gen)
    return inputs, torch.randint(0, TINY.vocab_size, inputs.shape, generator=gen)


def _make(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = build_model(TINY)
    return model, build_optimizer(model, _config(name))


def _train(model, opt, steps: int) -> list[float]:
    inputs, labels = _batch()
    losses = []
    for _ in range(steps):
        loss = cross_entropy_sum(model(inputs), labels) / labels.numel()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", NAMES)
def test_each_optimizer_decreases_the_loss(name):
    model, opt = _make(name)
    losses = _train(model, opt, 30)
    assert losses[-1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("name", NAMES)
def test_resume_from_state_dict_matches_uninterrupted_run_bitwise(name):
    model, opt = _make(name)
    reference_losses = _train(model, opt, 10)

    first, first_opt = _make(name)
    losses = _train(first, first_opt, 5)
    model_sd = copy.deepcopy(first.state_dict())
    opt_sd = copy.deepcopy(first_opt.state_dict())
    resumed, resumed_opt = _make(name, seed=1)  # different init: everything comes from the dicts
    resumed.load_state_dict(model_sd)
    resumed_opt.load_state_dict(opt_sd)
    losses += _train(resumed, resumed_opt, 5)

    assert losses == reference_losses
    for (n, a), b in zip(model.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), n


def test_schedule_free_checkpoint_at_x_then_train_mode_resumes_bitwise():
    model, opt = _make("schedule_free_adamw")
    reference_losses = _train(model, opt, 10)

    first, first_opt = _make("schedule_free_adamw")
    losses = _train(first, first_opt, 5)
    with optimizer_eval_mode(first_opt):  # what the loop does around a save
        model_sd = copy.deepcopy(first.state_dict())
        opt_sd = copy.deepcopy(first_opt.state_dict())
    resumed, resumed_opt = _make("schedule_free_adamw", seed=1)
    resumed.load_state_dict(model_sd)
    resumed_opt.load_state_dict(opt_sd)
    set_optimizer_mode(resumed_opt, True)  # what the loop does after a load
    losses += _train(resumed, resumed_opt, 5)
    assert losses == reference_losses


def test_schedule_free_eval_mode_moves_params_to_x_and_restores_exactly():
    model, opt = _make("schedule_free_adamw")
    _train(model, opt, 5)
    assert isinstance(opt, ScheduleFreeAdamW)
    y = [p.detach().clone() for p in model.parameters()]
    with optimizer_eval_mode(opt):
        for p in model.parameters():
            assert torch.equal(p, opt.state[p]["x"])
        assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), y, strict=True))
        with pytest.raises(RuntimeError, match="eval mode"):
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), y, strict=True))


def test_set_optimizer_mode_is_a_no_op_for_other_optimizers():
    model, opt = _make("adamw")
    _train(model, opt, 2)
    before = [p.detach().clone() for p in model.parameters()]
    with optimizer_eval_mode(opt):
        pass
    set_optimizer_mode(opt, False)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("shape", [(32, 32), (96, 32), (32, 96)])
def test_newton_schulz_singular_values_are_near_one(shape):
    matrix = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    ortho = newton_schulz_orthogonalize(matrix, steps=5)
    assert ortho.shape == matrix.shape
    singular = torch.linalg.svdvals(ortho)
    assert singular.min() > 0.5 and singular.max() < 1.5, singular


def test_muon_puts_embedding_head_and_1d_params_on_the_adamw_side():
    model, opt = _make("muon")
    assert isinstance(opt, Muon)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = [names[id(p)] for g in opt.param_groups if g["use_muon"] for p in g["params"]]
    adam = [names[id(p)] for g in opt.param_groups if not g["use_muon"] for p in g["params"]]
    assert opt.param_groups[0]["use_muon"]
    assert "tok_embeddings.weight" in adam and "output.weight" in adam
    assert all(model.get_parameter(n).ndim == 2 for n in muon)
    assert not any(n.endswith(("tok_embeddings.weight", "output.weight")) for n in muon)
    assert all(model.get_parameter(n).ndim == 1 for n in adam if "weight" in n and "norm" in n)
    assert len(muon) + len(adam) == len(list(model.parameters()))
    assert {g["lr"] for g in opt.param_groups if not g["use_muon"]} == {3e-3}


def test_muon_takes_expert_stacks_and_leaves_routers_to_adamw():
    """On an MoE model: the experts' 3-D stacks are hidden matrices, in a Muon group of
    their own whose outputs are on the last dimension; the routers' gates, a few rows of
    logits, stay on AdamW with the embedding and the head."""
    torch.manual_seed(0)
    moe = ModelConfig(**{**TINY.__dict__, "num_experts": 4, "moe_top_k": 2})
    model = build_model(moe)
    opt = build_optimizer(model, _config("muon"))
    names = {id(p): n for n, p in model.named_parameters()}
    side = {names[id(p)]: g for g in opt.param_groups for p in g["params"]}
    experts = [n for n in side if ".experts." in n]
    routers = [n for n in side if n.endswith("router.gate.weight")]
    assert experts and routers
    assert all(side[n]["use_muon"] and side[n]["fan_out_dim"] == -1 for n in experts)
    assert all(not side[n]["use_muon"] for n in routers)
    dense = [n for n in side if side[n]["use_muon"] and n not in experts]
    assert dense and all(side[n]["fan_out_dim"] == -2 for n in dense)
    assert opt.param_groups[0]["use_muon"] and opt.param_groups[0]["fan_out_dim"] == -2


def test_muon_steps_each_expert_like_the_linear_layer_it_transposes():
    """A stack (experts, in, out) steps as its experts' nn.Linear weights (out, in) would,
    one matrix at a time, transposed: the same Newton-Schulz per matrix and the same
    sqrt(fan_out / fan_in) scale. In float64; the two differ only by the order of the
    matmuls' sums (batched against one at a time, one operand transposed), each of
    NS_STEPS iterations moving an element by at most reorder_atol of its 8 + 8 + 24 terms
    (normalised, so each at most the coefficients' 4.8 + 2.1 + 3.5 < 11 in size), which the
    rest of the map amplifies by at most newton_schulz_sensitivity."""
    from tests.support.tolerance import newton_schulz_sensitivity, reorder_atol, unit_roundoff

    experts, fan_in, fan_out, steps, lr, ns_steps = 3, 8, 24, 2, 0.02, 5
    gen = torch.Generator().manual_seed(0)
    stack = torch.randn(experts, fan_in, fan_out, generator=gen, dtype=torch.float64)
    grads = [torch.randn(stack.shape, generator=gen, dtype=torch.float64) for _ in range(steps)]
    stacked = torch.nn.Parameter(stack.clone())
    linear = [torch.nn.Parameter(stack[e].T.clone()) for e in range(experts)]
    opt_stack = Muon([{"params": [stacked], "fan_out_dim": -1}], lr=lr, weight_decay=0.1)
    opt_linear = Muon(linear, lr=lr, weight_decay=0.1)
    for g in grads:
        stacked.grad = g.clone()
        for e, p in enumerate(linear):
            p.grad = g[e].T.clone()
        opt_stack.step()
        opt_linear.step()
    scale = (fan_out / fan_in) ** 0.5
    per_iteration = reorder_atol(torch.float64, 8 + 8 + 24, 11.0) * (fan_in * fan_out) ** 0.5
    for e, p in enumerate(linear):
        buf = opt_linear.state[p]["momentum_buffer"]
        sensitivity = newton_schulz_sensitivity(grads[-1][e].T + 0.95 * buf, ns_steps)
        ortho_bound = ns_steps * per_iteration * max(1.0, sensitivity)
        bound = steps * (lr * scale * ortho_bound + 4 * unit_roundoff(torch.float64) * 10)
        assert (stacked.detach()[e] - p.detach().T).abs().max().item() <= bound
        assert torch.equal(opt_stack.state[stacked]["momentum_buffer"][e], buf.T)


def test_scheduler_scales_each_muon_group_from_its_own_lr():
    model, opt = _make("muon")
    sched = build_scheduler(opt, SchedulerConfig(warmup_steps=4), max_steps=10)
    lrs = {g["use_muon"]: g["lr"] for g in opt.param_groups}
    assert lrs[True] == pytest.approx(0.02 / 4) and lrs[False] == pytest.approx(3e-3 / 4)
    assert [g["initial_lr"] for g in opt.param_groups] == sched.base_lrs


@pytest.mark.parametrize("name", NAMES)
def test_dcp_state_dict_of_a_fresh_optimizer_leaves_params_and_loads_back(name):
    """The checkpoint manager's get_state_dict steps a fresh optimizer at lr 0."""
    model, opt = _make(name)
    before = [p.detach().clone() for p in model.parameters()]
    model_sd, opt_sd = get_state_dict(model, opt)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert all(g["lr"] > 0 for g in opt.param_groups)  # restored after the lr-0 step
    _train(model, opt, 3)
    model_sd, opt_sd = copy.deepcopy(get_state_dict(model, opt))  # DCP writes a copy to disk
    other, other_opt = _make(name, seed=1)
    set_state_dict(other, other_opt, model_state_dict=model_sd, optim_state_dict=opt_sd)
    assert _train(model, opt, 2) == _train(other, other_opt, 2)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("muon_momentum", 1.0),
        ("muon_ns_steps", 0),
        ("muon_adam_lr", -1.0),
        ("schedule_free_warmup_steps", -1),
    ],
)
def test_new_optimizer_fields_are_checked(field, value):
    with pytest.raises(ConfigError, match=f"optimizer.{field}"):
        OptimizerConfig(**{field: value})


def test_unknown_optimizer_name_lists_the_new_choices():
    model = build_model(TINY)
    with pytest.raises(ConfigError, match="expected one of adamw, lion, muon, schedule_free_adamw"):
        build_optimizer(model, OptimizerConfig(name="lino"))


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("configs/train/lion.toml", "lion"),
        ("configs/train/muon.toml", "muon"),
        ("configs/train/schedule_free.toml", "schedule_free_adamw"),
    ],
)
def test_example_configs_load_and_build(path, name):
    config = load_config(path)
    config.validate(world_size=1)
    assert config.optimizer.name == name and config.train.max_steps == 400  # from debug.toml
    opt = build_optimizer(build_model(TINY), config.optimizer)
    build_scheduler(opt, config.scheduler, config.train.max_steps)
