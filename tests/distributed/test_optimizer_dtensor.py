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
                torch.allclose(a, e, rtol=1e-6, atol=1e-7)
                for a, e in zip(actual, expected, strict=True)
            )
    return agree


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
