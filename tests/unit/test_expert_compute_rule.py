"""Which expert compute 'auto' picks: torch's own grouped_mm condition, per device."""

from __future__ import annotations

import pytest
import torch

from kempnerforge.model.moe.experts import grouped_mm_runs
from tests.support.tolerance import assert_reordered_close


@pytest.mark.parametrize(
    ("capability", "expected"),
    [((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True), ((10, 0), True)],
)
def test_bf16_grouped_mm_runs_from_compute_capability_8_0(capability, expected) -> None:
    # An A100 (8.0) takes torch's grouped matmul, not the padded path.
    assert grouped_mm_runs("cuda", capability, torch.bfloat16, (64, 128)) is expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_grouped_mm_needs_bf16(dtype: torch.dtype) -> None:
    assert not grouped_mm_runs("cuda", (9, 0), dtype, (64, 128))


def test_cpu_grouped_mm_runs_in_every_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert grouped_mm_runs("cpu", None, dtype, (64, 128))


def test_grouped_mm_needs_inner_widths_of_16_bytes() -> None:
    # 36 bf16 elements are 72 bytes, not a multiple of 16.
    assert not grouped_mm_runs("cuda", (9, 0), torch.bfloat16, (36, 128))
    assert not grouped_mm_runs("cpu", None, torch.float32, (64, 6))
    assert grouped_mm_runs("cpu", None, torch.float32, (64, 4))


def test_an_unknown_device_type_takes_the_padded_path() -> None:
    assert not grouped_mm_runs("mps", None, torch.bfloat16, (64, 128))


@pytest.mark.parametrize("compute", ["grouped_mm", "padded_bmm", "looped"])
def test_rows_past_the_last_group_get_zero_outputs_and_no_gradient(compute: str) -> None:
    """Dropped assignments stay in the rows, after every group: the kept rows compute as if
    the dropped ones were cut off, which the grouped matmul does without a host read."""
    from kempnerforge.model.moe.experts import grouped_swiglu

    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 2, 1])
    rows = torch.randn(9, 16, generator=gen, requires_grad=True)
    weights = [torch.randn(4, 16, 32, generator=gen), torch.randn(4, 16, 32, generator=gen)]
    weights.append(torch.randn(4, 32, 16, generator=gen))
    weights = [w.requires_grad_() for w in weights]
    out = grouped_swiglu(rows, counts, *weights, compute)
    assert out.shape == (9, 16) and torch.equal(out[6:], torch.zeros(3, 16))
    out.square().sum().backward()
    grads = [rows.grad, *(w.grad for w in weights)]
    assert torch.equal(rows.grad[6:], torch.zeros(3, 16))
    for t in (rows, *weights):
        t.grad = None
    cut = grouped_swiglu(rows[:6], counts, *weights, "looped")
    cut.square().sum().backward()
    # The batched matmul and the looped reference sum in kernel-chosen orders (AVX2 and
    # AVX-512 differ), so fp32 reordering bounds them. The longest chain of sums: dim (16)
    # into the gate, hidden (32) into the output, dim (16) back into the hidden's gradient,
    # hidden twice (64) into the rows' gradient; 128 terms in all. A dropped row moves a
    # gradient by a share of its largest entry, far past 256 * 2**-24 of it.
    assert_reordered_close(out[:6], cut, terms=16 + 32)
    for got, want in zip(grads, [rows.grad, *(w.grad for w in weights)], strict=True):
        assert_reordered_close(got[: want.shape[0]], want, terms=16 + 32 + 16 + 64)
