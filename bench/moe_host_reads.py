"""Host reads per MoE layer: how many times one training forward and backward of an MoE
layer of the debug_moe shape reads a device value to the host, per expert compute and
with or without a capacity factor (one rank; expert parallelism adds one read of the
split sizes per exchange, see docs/moe.md).

A read is counted where a tensor becomes a Python number or list (item, tolist, int,
float, bool): on a GPU each is a device synchronisation. Counts, not times: the numbers
are the same on every machine.

    python bench/moe_host_reads.py
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from kempnerforge.config.loader import load_config
from kempnerforge.model.moe.layer import MoEFeedForward
from kempnerforge.model.weight_init import fill_parameter


@contextlib.contextmanager
def counting_host_reads() -> Iterator[list[int]]:
    """Count the Tensor -> Python conversions made inside the block."""
    count = [0]
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def wrap(name: str):
        inner = originals[name]

        def counted(self, *args, **kwargs):
            count[0] += 1
            return inner(self, *args, **kwargs)

        return counted

    for name in names:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield count
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def reads(compute: str, capacity: float | None) -> int:
    extra = [] if capacity is None else [f"--model.moe_capacity_factor={capacity}"]
    cfg = load_config("configs/train/debug_moe.toml", extra).model
    layer = MoEFeedForward(cfg)
    for param in layer.parameters():
        fill_parameter(param, 0.02, seed=0)
    layer.experts.compute = compute
    x = torch.randn(4, 64, cfg.dim, requires_grad=True)
    layer(x)  # warm-up outside the count
    with counting_host_reads() as count:
        layer(x).square().mean().backward()
    return count[0]


def main() -> None:
    print(f"{'expert compute':<16}{'dropless':>10}{'capacity 1.0':>14}")
    for compute in ("grouped_mm", "padded_bmm"):
        print(f"{compute:<16}{reads(compute, None):>10}{reads(compute, 1.0):>14}")


if __name__ == "__main__":
    main()
