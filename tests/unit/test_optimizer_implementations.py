"""optimizer.implementation: every path of every optimizer gives the per-parameter result
(AdamW against torch's for-loop; Lion, Muon and schedule-free against the straightforward
references below), keeps the state layout checkpoints hold, and 'fused' is AdamW's only."""

from __future__ import annotations

import math

import pytest
import torch

from kempnerforge.config.model import ModelConfig
from kempnerforge.config.optimizer import OptimizerConfig
from kempnerforge.core.errors import ConfigError
from kempnerforge.model import build_model
from kempnerforge.optim.lion import Lion
from kempnerforge.optim.multi_tensor import bucket, use_foreach
from kempnerforge.optim.muon import Muon, newton_schulz_orthogonalize
from kempnerforge.optim.optimizer import build_optimizer
from kempnerforge.optim.schedule_free import ScheduleFreeAdamW
from tests.support.tolerance import assert_reordered_close, reorder_atol

STEPS = 6
# An implementation and its reference run the same rule with other kernels (foreach, fused,
# lerp against mul and add). Per step a value is rounded about twice at its own scale
# (decay, step) and about ten times in its update (moments, bias corrections, square root,
# division, Newton-Schulz's normalised matmuls), an update no larger than the values here:
# 12 roundings a step, STEPS steps. A missing decay or bias correction moves a value by a
# share of lr (1e-3 or more), far past that.
STEP_TERMS = 12 * STEPS
FOREACH = {"for_loop": False, "foreach": True, "auto": None}
TINY = ModelConfig(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=16, multiple_of=16)

# --- straightforward per-parameter references ------------------------------------------
# Each takes (params, grads, state, hyperparameters) for one group and one step; state is a
# dict per parameter index. A parameter whose grad is None is skipped.


def ref_lion(params, grads, state, lr, wd, betas):
    """Also counts, per coordinate, the steps whose interpolated momentum lay within an
    implementation's roundings (STEP_TERMS at its terms' scale) of zero: there another
    kernel may take the other sign."""
    beta1, beta2 = betas
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        s = state.setdefault(i, {"exp_avg": torch.zeros_like(p), "near_zero": torch.zeros_like(p)})
        m = s["exp_avg"]
        interpolated = beta1 * m + (1 - beta1) * g
        scale = beta1 * m.abs() + (1 - beta1) * g.abs()
        s["near_zero"] += interpolated.abs() <= reorder_atol(torch.float32, STEP_TERMS, 1.0) * scale
        update = interpolated.sign()
        p.mul_(1 - lr * wd).sub_(lr * update)
        m.mul_(beta2).add_((1 - beta2) * g)


def ref_muon(params, grads, state, lr, wd, momentum, ns_steps):
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        buf = state.setdefault(i, {"momentum_buffer": torch.zeros_like(p)})["momentum_buffer"]
        buf.mul_(momentum).add_(g)
        ortho = newton_schulz_orthogonalize(g + momentum * buf, ns_steps)
        scale = math.sqrt(max(1.0, p.size(0) / p.size(1)))
        p.mul_(1 - lr * wd).sub_(lr * scale * ortho)


def ref_adamw(params, grads, state, lr, wd, betas, eps):
    beta1, beta2 = betas
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        s = state.setdefault(
            i, {"step": 0, "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
        )
        s["step"] += 1
        t = s["step"]
        s["exp_avg"].mul_(beta1).add_((1 - beta1) * g)
        s["exp_avg_sq"].mul_(beta2).add_((1 - beta2) * g * g)
        m_hat = s["exp_avg"] / (1 - beta1**t)
        v_hat = s["exp_avg_sq"] / (1 - beta2**t)
        p.mul_(1 - lr * wd).sub_(lr * m_hat / (v_hat.sqrt() + eps))


def ref_schedule_free(params, grads, state, group, lr, wd, betas, eps, warmup):
    """group: the per-group counters {"k", "weight_sum"}."""
    beta1, beta2 = betas
    group["k"] += 1
    k = group["k"]
    lr_t = lr * (min(1.0, k / warmup) if warmup else 1.0) * math.sqrt(1 - beta2**k)
    group["weight_sum"] += lr_t**2
    c = lr_t**2 / group["weight_sum"]
    for i, (p, g) in enumerate(zip(params, grads, strict=True)):
        if g is None:
            continue
        s = state.setdefault(i, {"z": p.clone(), "x": p.clone(), "v": torch.zeros_like(p)})
        s["v"].mul_(beta2).add_((1 - beta2) * g * g)
        s["z"].sub_(lr_t * (g / (s["v"].sqrt() + eps) + wd * p))
        s["x"].mul_(1 - c).add_(c * s["z"])
        p.copy_(beta1 * s["x"] + (1 - beta1) * s["z"])


# --- a fixed problem: shapes, groups of different lr / wd, parameters without a gradient

SHAPES = [(24, 24), (40, 16), (16, 40), (24,), (7, 5), (6,)]
NO_GRAD_ON_ODD_STEPS = (2, 3)


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen) * 0.1) for s in SHAPES]


def _grads(step: int) -> list[torch.Tensor | None]:
    """One step's random gradients; NO_GRAD_ON_ODD_STEPS have none on odd steps."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = [torch.randn(*s, generator=gen) for s in SHAPES]
    return [None if i in NO_GRAD_ON_ODD_STEPS and step % 2 else g for i, g in enumerate(grads)]


def _train(opt: torch.optim.Optimizer, params: list[torch.nn.Parameter]) -> None:
    for step in range(STEPS):
        for p, g in zip(params, _grads(step), strict=True):
            p.grad = g
        opt.step()


def _reference(groups, step_group) -> tuple[list[torch.Tensor], list[dict]]:
    """Parameters and per-group states after STEPS steps of step_group(group, ps, gs, state,
    counter) over [(indices, hyperparameters)]."""
    params = [p.detach() for p in _params()]
    states: list[dict] = [{} for _ in groups]
    counters = [{"k": 0, "weight_sum": 0.0} for _ in groups]
    for step in range(STEPS):
        grads = _grads(step)
        for (idx, hp), state, counter in zip(groups, states, counters, strict=True):
            ps, gs = [params[i] for i in idx], [grads[i] for i in idx]
            step_group(hp, ps, gs, state, counter)
    return params, states


def _torch_groups(params, groups) -> list[dict]:
    return [
        {"params": [params[i] for i in idx], "lr": hp["lr"], "weight_decay": hp["wd"]}
        | ({"use_muon": hp["muon"]} if "muon" in hp else {})
        for idx, hp in groups
    ]


def _assert_close(actual, expected) -> None:
    for a, e in zip(actual, expected, strict=True):
        assert_reordered_close(a, e, terms=STEP_TERMS)


def _assert_states(opt, params, groups, states, keys: dict[str, str]) -> None:
    """Each optimizer state tensor (keys: optimizer's name -> reference's) matches."""
    for (idx, _), state in zip(groups, states, strict=True):
        assert set(state) == {i for i in range(len(idx))}, "every parameter was stepped"
        for i, ref in state.items():
            saved = opt.state[params[idx[i]]]
            names = [k for k in keys if k in saved]
            _assert_close([saved[k] for k in names], [ref[keys[k]] for k in names])


LION = [([0, 1, 2, 4], {"lr": 1e-2, "wd": 0.5}), ([3, 5], {"lr": 3e-3, "wd": 0.0})]
MUON = [
    ([0, 1], {"lr": 0.02, "wd": 0.1, "muon": True}),
    ([2], {"lr": 0.01, "wd": 0.0, "muon": True}),
    ([4, 3], {"lr": 3e-3, "wd": 0.05, "muon": False}),  # a matrix and a vector
    ([5], {"lr": 5e-3, "wd": 0.0, "muon": False}),
]
SCHEDULE_FREE = [([0, 1, 2, 4], {"lr": 1e-2, "wd": 0.1}), ([3, 5], {"lr": 3e-3, "wd": 0.0})]
BETAS, EPS, MU, NS_STEPS, WARMUP = (0.9, 0.95), 1e-8, 0.95, 5, 3


def _lion(foreach):
    params = _params()
    return params, Lion(_torch_groups(params, LION), betas=BETAS, foreach=foreach)


def _muon(foreach):
    params = _params()
    groups = _torch_groups(params, MUON)
    return params, Muon(
        groups, momentum=MU, ns_steps=NS_STEPS, betas=BETAS, eps=EPS, foreach=foreach
    )


def _schedule_free(foreach):
    params = _params()
    groups = _torch_groups(params, SCHEDULE_FREE)
    opt = ScheduleFreeAdamW(groups, betas=BETAS, eps=EPS, warmup_steps=WARMUP, foreach=foreach)
    return params, opt


@pytest.mark.parametrize("impl", FOREACH)
def test_lion_matches_the_per_parameter_reference(impl):
    params, opt = _lion(FOREACH[impl])
    _train(opt, params)
    expected, states = _reference(
        LION, lambda hp, ps, gs, st, _: ref_lion(ps, gs, st, hp["lr"], hp["wd"], BETAS)
    )
    # A sign taken the other way moves a weight by 2 lr, and only where the reference's
    # momentum was within the roundings of zero; the momentum itself never depends on it.
    per_magnitude = reorder_atol(torch.float32, STEP_TERMS, 1.0)
    for (idx, hp), state in zip(LION, states, strict=True):
        for i, ref in state.items():
            want = expected[idx[i]]
            flips = 2 * hp["lr"] * ref["near_zero"] / per_magnitude
            magnitude = want.abs().max() + flips
            assert_reordered_close(params[idx[i]], want, terms=STEP_TERMS, magnitude=magnitude)
    _assert_states(opt, params, LION, states, {"exp_avg": "exp_avg"})


def _muon_reference_step(hp, ps, gs, state, _counter) -> None:
    if hp["muon"]:
        ref_muon(ps, gs, state, hp["lr"], hp["wd"], MU, NS_STEPS)
    else:
        ref_adamw(ps, gs, state, hp["lr"], hp["wd"], BETAS, EPS)


@pytest.mark.parametrize("impl", FOREACH)
def test_muon_matches_the_per_parameter_reference(impl):
    params, opt = _muon(FOREACH[impl])
    _train(opt, params)
    expected, states = _reference(MUON, _muon_reference_step)
    _assert_close(params, expected)
    keys = {"momentum_buffer": "momentum_buffer", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
    _assert_states(opt, params, MUON, states, keys)
    for (idx, hp), state in zip(MUON, states, strict=True):
        for i, ref in state.items():
            if not hp["muon"]:
                assert opt.state[params[idx[i]]]["step"].item() == ref["step"]


@pytest.mark.parametrize("impl", FOREACH)
def test_schedule_free_matches_the_per_parameter_reference(impl):
    params, opt = _schedule_free(FOREACH[impl])
    _train(opt, params)
    expected, states = _reference(
        SCHEDULE_FREE,
        lambda hp, ps, gs, st, counter: ref_schedule_free(
            ps, gs, st, counter, hp["lr"], hp["wd"], BETAS, EPS, WARMUP
        ),
    )
    _assert_close(params, expected)
    _assert_states(opt, params, SCHEDULE_FREE, states, {"x": "x", "z": "z", "exp_avg_sq": "v"})


@pytest.mark.parametrize("make", [_lion, _muon, _schedule_free])
def test_foreach_equals_the_loop_bitwise_on_cpu(make):
    """Same operations in the same order: a run may switch between the two and resume."""
    loop_params, loop_opt = make(False)
    foreach_params, foreach_opt = make(True)
    _train(loop_opt, loop_params)
    _train(foreach_opt, foreach_params)
    assert all(torch.equal(a, b) for a, b in zip(loop_params, foreach_params, strict=True))


@pytest.mark.parametrize("make", [_lion, _muon, _schedule_free])
def test_a_group_of_mixed_dtypes_steps_each_dtype_like_the_loop(make):
    loop_params, loop_opt = make(False)
    foreach_params, foreach_opt = make(True)
    for params in (loop_params, foreach_params):
        params[4].data = params[4].data.double()
        params[5].data = params[5].data.bfloat16()
    for opt, params in ((loop_opt, loop_params), (foreach_opt, foreach_params)):
        for step in range(STEPS):
            for p, g in zip(params, _grads(step), strict=True):
                p.grad = None if g is None else g.to(p.dtype)
            opt.step()
    assert foreach_params[4].dtype == torch.float64
    assert all(torch.equal(a, b) for a, b in zip(loop_params, foreach_params, strict=True))


def _tiny_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(TINY)


def _adamw_run(implementation: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _tiny_model()
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2, implementation=implementation))
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return model, opt


@pytest.mark.parametrize("impl", ["foreach", "fused", "auto"])
def test_adamw_implementations_agree_with_the_for_loop(impl):
    reference, _ = _adamw_run("for_loop")
    model, _ = _adamw_run(impl)
    _assert_close(list(model.parameters()), list(reference.parameters()))


def test_auto_adamw_is_fused_on_cpu_and_foreach_where_the_kernel_is_missing():
    model = _tiny_model()
    group = build_optimizer(model, OptimizerConfig()).param_groups[0]
    assert group["fused"] is True and not group["foreach"]
    meta = torch.nn.Linear(4, 4, device="meta")  # a device without a fused kernel
    group = build_optimizer(meta, OptimizerConfig()).param_groups[0]
    assert group["foreach"] is True and not group["fused"]


@pytest.mark.parametrize(("impl", "flag"), [("auto", None), ("foreach", True), ("for_loop", False)])
@pytest.mark.parametrize("name", ["lion", "muon", "schedule_free_adamw"])
def test_implementation_reaches_every_group_of_the_other_optimizers(name, impl, flag):
    opt = build_optimizer(_tiny_model(), OptimizerConfig(name=name, implementation=impl))
    assert {g["foreach"] for g in opt.param_groups} == {flag}


@pytest.mark.parametrize("name", ["lion", "muon", "schedule_free_adamw"])
def test_fused_is_refused_for_optimizers_without_a_fused_kernel(name):
    with pytest.raises(ConfigError) as e:
        OptimizerConfig(name=name, implementation="fused")
    assert str(e.value).startswith("optimizer.implementation = 'fused': expected 'auto', ")
    assert f"optimizer.name = '{name}'" in str(e.value) and "adamw only" in str(e.value)


def _layout(opt: torch.optim.Optimizer) -> list[dict[str, tuple]]:
    return [
        {k: (v.shape, v.dtype, v.device) for k, v in s.items()}
        for s in opt.state_dict()["state"].values()
    ]


@pytest.mark.parametrize("name", ["lion", "muon", "schedule_free_adamw"])
def test_state_layout_is_the_same_for_every_implementation(name):
    """Checkpoints keep loading: same state keys, shapes, dtypes and devices."""
    layouts = []
    for impl in ("for_loop", "foreach", "auto"):
        model = _tiny_model()
        opt = build_optimizer(model, OptimizerConfig(name=name, implementation=impl))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        layouts.append(_layout(opt))
    assert layouts[0] == layouts[1] == layouts[2]
    if name == "muon":  # the internal AdamW's step counts stay CPU float32 scalars
        steps = {s["step"] for s in layouts[0] if "step" in s}
        assert steps == {(torch.Size([]), torch.float32, torch.device("cpu"))}


@pytest.mark.parametrize("name", ["lion", "muon", "schedule_free_adamw"])
def test_a_state_dict_saved_before_the_switch_loads_and_steps(name):
    model = _tiny_model()
    opt = build_optimizer(model, OptimizerConfig(name=name))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        del group["foreach"]
    other = build_optimizer(model, OptimizerConfig(name=name, implementation="for_loop"))
    other.load_state_dict(saved)
    assert {g["foreach"] for g in other.param_groups} == {None}
    other.step()


def test_auto_loops_over_cpu_tensors_and_goes_foreach_elsewhere():
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")  # meta: a non-CPU device
    assert use_foreach(None, [cpu]) is False and use_foreach(None, [meta]) is True
    assert use_foreach(True, [cpu]) is True and use_foreach(False, [meta]) is False


def test_buckets_split_by_device_and_dtype_and_keep_the_order():
    a, b = torch.zeros(1), torch.zeros(2)
    half, meta = torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, device="meta")
    tensors = [a, half, b, meta]
    buckets = bucket(tensors, [t.clone() for t in tensors])
    assert [[t.numel() for t in ts] for ts, _ in buckets] == [[1, 2], [3], [4]]
    assert all(x.shape == y.shape for ts, cs in buckets for x, y in zip(ts, cs, strict=True))
