"""The foreach and fused optimizer paths on sharded DTensor parameters (what FSDP2 hands
the optimizer) give what the per-parameter loop gives on the full tensors."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kempnerforge.optim.lion import Lion
from kempnerforge.optim.multi_tensor import DTENSOR_LACKS, foreach_or_loop
from kempnerforge.optim.muon import Muon
from kempnerforge.optim.optimizer import fused_adamw_supported
from kempnerforge.optim.schedule_free import ScheduleFreeAdamW
from tests.support.dist import run_distributed
from tests.support.tolerance import reorder_atol

pytestmark = pytest.mark.distributed

SHAPES = [(8, 6), (7, 5), (9,)]  # (7, 5) and (9,) shard unevenly over two ranks
STEPS = 4
CASES = {
    "lion": lambda ps, foreach: Lion(ps, lr=1e-2, weight_decay=0.1, foreach=foreach),
    "schedule_free": lambda ps, foreach: ScheduleFreeAdamW(
        ps, lr=1e-2, weight_decay=0.1, warmup_steps=2, foreach=foreach
    ),
    # Newton-Schulz needs whole matrices, so only Muon's AdamW side runs on shards.
    "muon_adamw_side": lambda ps, foreach: Muon(
        [{"params": ps, "use_muon": False}], lr=1e-2, weight_decay=0.1, foreach=foreach
    ),
    "adamw": lambda ps, foreach: torch.optim.AdamW(
        ps,
        lr=1e-2,
        weight_decay=0.1,
        **({"fused": True} if foreach is None else {"foreach": foreach}),
    ),
}


def _run(make, foreach: bool | None, mesh) -> list[torch.Tensor]:
    """STEPS steps from fixed weights and gradients; full tensors of the result."""
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(*s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(*s, generator=gen) for s in SHAPES] for _ in range(STEPS)]
    place = (lambda t: distribute_tensor(t, mesh, [Shard(0)])) if mesh else (lambda t: t)
    params = [torch.nn.Parameter(place(t)) for t in full]
    opt = make(params, foreach)
    for step_grads in grads:
        for p, g in zip(params, step_grads, strict=True):
            p.grad = place(g)
        opt.step()
    if isinstance(opt, ScheduleFreeAdamW):  # the DTensor copy path of eval() and train()
        opt.eval()
        opt.train()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]


def _sharded_against_the_loop(rank: int, world_size: int) -> dict[str, bool]:
    mesh = init_device_mesh("cpu", (world_size,))
    shards = [
        torch.nn.Parameter(distribute_tensor(torch.zeros(*s), mesh, [Shard(0)])) for s in SHAPES
    ]
    agree = {"auto_adamw_is_fused": fused_adamw_supported([{"params": shards}])}
    agree["refused_foreach_takes_the_loop"] = _refused_foreach_takes_the_loop(mesh)
    for name, make in CASES.items():
        expected = _run(make, False, None)
        for foreach in (True, None):
            actual = _run(make, foreach, mesh)
            agree[f"{name}/{foreach}"] = all(
                _within_roundings(a, e) for a, e in zip(actual, expected, strict=True)
            ) and (name != "lion" or _lion_signs_are_clear())
    return agree


def _lion_signs_are_clear() -> bool:
    """Every interpolated momentum whose sign Lion steps by lies further from zero than the
    roundings _within_roundings allows at its terms' scale, so no kernel can flip a sign
    (a flip would move a weight by 2 * lr). Recomputed from _run's draws in float64."""
    gen = torch.Generator().manual_seed(0)
    [torch.randn(*s, generator=gen) for s in SHAPES]  # the weights, drawn first
    grads = [[torch.randn(*s, generator=gen).double() for s in SHAPES] for _ in range(STEPS)]
    beta1, beta2 = 0.9, 0.99  # Lion's defaults, as CASES builds it
    moms = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
    for step_grads in grads:
        for m, g in zip(moms, step_grads, strict=True):
            scale = beta1 * m.abs() + (1 - beta1) * g.abs()
            if bool(
                (
                    (beta1 * m + (1 - beta1) * g).abs()
                    <= reorder_atol(torch.float32, 12 * STEPS, 1.0) * scale
                ).any()
            ):
                return False
            m.mul_(beta2).add_((1 - beta2) * g)
    return True


def _within_roundings(actual: torch.Tensor, expected: torch.Tensor) -> bool:
    """Foreach and fused kernels on shards against the loop on whole tensors: the same rule,
    elementwise, but other kernels (a shard's vectorised body and scalar tail fall on other
    elements; fused and FMA forms round once where mul and add round twice). A value is
    rounded about a dozen times a step at the scale of the values here (as in
    tests/unit/test_optimizer_implementations.py): STEPS steps of 12 roundings. A missing
    decay or bias correction moves a value by a share of lr (1e-2), far past that. Lion's
    sign of the interpolated momentum could flip only where that momentum is within these
    roundings of zero, which _lion_signs_are_clear rules out for these draws."""
    bound = reorder_atol(torch.float32, 12 * STEPS, expected.abs().max().item())
    return bool(((actual - expected).abs() <= bound).all())


def _refused_foreach_takes_the_loop(mesh) -> bool:
    """DTensor has no sharding rule for the foreach copy in any torch this runs on: the
    copy happens one tensor at a time, and the refusal is remembered."""
    gen = torch.Generator().manual_seed(1)
    src = [distribute_tensor(torch.randn(*s, generator=gen), mesh, [Shard(0)]) for s in SHAPES]
    dst = [distribute_tensor(torch.zeros(*s), mesh, [Shard(0)]) for s in SHAPES]
    loops = []

    def copy_each(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        loops.append(len(dst))
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)

    for _ in range(2):
        foreach_or_loop("copy_", copy_each, dst, src)
    pairs = zip(dst, src, strict=True)
    copied = all(torch.equal(d.full_tensor(), s.full_tensor()) for d, s in pairs)
    return copied and loops == [len(SHAPES)] * 2 and "copy_" in DTENSOR_LACKS


@pytest.fixture(scope="module")
def agreement() -> list[dict[str, bool]]:
    return run_distributed(_sharded_against_the_loop, 2)


@pytest.mark.parametrize("case", [f"{n}/{f}" for n in CASES for f in (True, None)])
def test_sharded_parameters_step_like_the_loop_on_full_tensors(agreement, case):
    assert [rank[case] for rank in agreement] == [True, True]


def test_auto_adamw_takes_the_fused_kernel_for_cpu_dtensors(agreement):
    assert [rank["auto_adamw_is_fused"] for rank in agreement] == [True, True]


def test_a_foreach_op_dtensor_refuses_runs_one_tensor_at_a_time(agreement):
    assert [rank["refused_foreach_takes_the_loop"] for rank in agreement] == [True, True]
