"""peak_flops_per_sec table and fallbacks, and the MFU ratio."""

from __future__ import annotations

import logging

import pytest
import torch

from kempnerforge.metrics import mfu as mfu_module
from kempnerforge.metrics.mfu import mfu, peak_flops_per_sec
from tests.support.logs import package_records


@pytest.fixture
def warnings_seen():
    """WARNING records of the kempnerforge loggers, whatever configure_logging did before."""
    with package_records(logging.WARNING) as records:
        yield records


@pytest.fixture
def fake_cuda(monkeypatch):
    """Pretend one CUDA device is present; returns a setter for its name and capability."""
    mfu_module._peak_for.cache_clear()
    state = {"name": "", "capability": (0, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: state["name"])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: state["capability"])

    def set_device(name: str, capability: tuple[int, int]) -> None:
        state["name"], state["capability"] = name, capability

    yield set_device
    mfu_module._peak_for.cache_clear()


def test_cpu_has_no_peak():
    assert peak_flops_per_sec(torch.device("cpu")) is None


@pytest.mark.parametrize(
    ("name", "capability", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), 989e12),
        ("NVIDIA H100 PCIe", (9, 0), 756e12),
        ("NVIDIA H100 NVL", (9, 0), 835e12),
        ("NVIDIA H200", (9, 0), 989e12),
        ("NVIDIA GH200 480GB", (9, 0), 989e12),
        ("NVIDIA A100-SXM4-80GB", (8, 0), 312e12),
        ("NVIDIA A100 80GB PCIe", (8, 0), 312e12),
        ("NVIDIA L40S", (8, 9), 362e12),
        ("NVIDIA A10G", (8, 6), 125e12),
        ("NVIDIA GeForce RTX 4090", (8, 9), 165e12),
    ],
)
def test_known_devices_use_the_dense_bf16_table(fake_cuda, name, capability, peak):
    fake_cuda(name, capability)
    assert peak_flops_per_sec(torch.device("cuda", 0)) == peak


@pytest.fixture
def tf32():
    """Set torch.backends.cuda.matmul.allow_tf32 for one test; restored afterwards."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32

    def set_tf32(allowed: bool) -> None:
        matmul.allow_tf32 = allowed

    yield set_tf32
    matmul.allow_tf32 = before


@pytest.mark.parametrize(
    ("name", "capability", "tf32_peak", "fp32_peak"),
    [
        ("NVIDIA H100 80GB HBM3", (9, 0), 494.7e12, 67e12),
        ("NVIDIA H100 PCIe", (9, 0), 378e12, 51e12),
        ("NVIDIA H100 NVL", (9, 0), 417.5e12, 60e12),
        ("NVIDIA H200", (9, 0), 494.7e12, 67e12),
        ("NVIDIA H200 NVL", (9, 0), 417.5e12, 60e12),
        ("NVIDIA GH200 480GB", (9, 0), 494.7e12, 67e12),
        ("NVIDIA A100-SXM4-80GB", (8, 0), 156e12, 19.5e12),
        ("NVIDIA L40S", (8, 9), 183e12, 91.6e12),
        ("NVIDIA GeForce RTX 4090", (8, 9), 82.6e12, 82.6e12),
        ("NVIDIA GeForce RTX 3090", (8, 6), 35.6e12, 35.6e12),
    ],
)
def test_fp32_uses_the_tf32_peak_only_when_tf32_is_allowed(
    fake_cuda, tf32, name, capability, tf32_peak, fp32_peak
):
    fake_cuda(name, capability)
    tf32(True)
    assert peak_flops_per_sec(torch.device("cuda", 0), "fp32") == tf32_peak
    tf32(False)
    assert peak_flops_per_sec(torch.device("cuda", 0), "fp32") == fp32_peak


def test_precision_picks_the_column(fake_cuda, tf32):
    fake_cuda("NVIDIA H100 80GB HBM3", (9, 0))
    tf32(False)
    device = torch.device("cuda", 0)
    assert peak_flops_per_sec(device, "bf16") == 989e12
    assert peak_flops_per_sec(device) == 989e12  # bf16 unless told otherwise
    assert peak_flops_per_sec(device, "fp32") == 67e12
    tf32(True)
    assert peak_flops_per_sec(device, "bf16") == 989e12  # TF32 does not touch bf16 matmuls


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cpu_has_no_peak_in_any_precision(precision):
    assert peak_flops_per_sec(torch.device("cpu"), precision) is None


def test_unknown_precision_is_a_programming_error():
    with pytest.raises(ValueError, match="precision must be one of"):
        peak_flops_per_sec(torch.device("cpu"), "fp16")


@pytest.mark.parametrize("allow_tf32", [True, False])
def test_a_device_without_an_fp32_figure_gets_no_mfu(fake_cuda, tf32, warnings_seen, allow_tf32):
    fake_cuda("NVIDIA A10G", (8, 6))
    tf32(allow_tf32)
    assert peak_flops_per_sec(torch.device("cuda"), "fp32") is None
    assert peak_flops_per_sec(torch.device("cuda"), "bf16") == 125e12
    dtype = "tf32" if allow_tf32 else "fp32"
    assert [r.getMessage() for r in warnings_seen] == [
        f"no {dtype} peak known for 'NVIDIA A10G'; MFU is not reported"
    ]


def test_unknown_datacenter_device_falls_back_by_capability_per_precision(
    fake_cuda, tf32, warnings_seen
):
    fake_cuda("NVIDIA Ampere Engineering Sample", (8, 0))
    tf32(False)
    assert peak_flops_per_sec(torch.device("cuda"), "fp32") == 19.5e12
    tf32(True)
    assert peak_flops_per_sec(torch.device("cuda"), "fp32") == 156e12
    assert [r.getMessage() for r in warnings_seen] == [
        "no fp32 peak known for 'NVIDIA Ampere Engineering Sample'; assuming 20 TFLOP/s from "
        "compute capability 8.0",
        "no tf32 peak known for 'NVIDIA Ampere Engineering Sample'; assuming 156 TFLOP/s from "
        "compute capability 8.0",
    ]


def test_unknown_datacenter_device_falls_back_by_capability(fake_cuda, warnings_seen):
    fake_cuda("NVIDIA Hopper Engineering Sample", (9, 0))
    assert peak_flops_per_sec(torch.device("cuda")) == 989e12
    assert peak_flops_per_sec(torch.device("cuda")) == 989e12
    assert len(warnings_seen) == 1  # once per device, not once per call
    assert "assuming 989 TFLOP/s" in warnings_seen[0].getMessage()


def test_unknown_consumer_device_gets_no_peak(fake_cuda, warnings_seen):
    fake_cuda("NVIDIA GeForce RTX 4060", (8, 9))
    assert peak_flops_per_sec(torch.device("cuda")) is None
    assert "MFU is not reported" in warnings_seen[0].getMessage()


def test_cuda_device_without_cuda_has_no_peak(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert peak_flops_per_sec(torch.device("cuda")) is None


def test_mfu_is_achieved_over_peak_flops():
    assert mfu(5_000.0, 6e9, 1e14) == pytest.approx(0.3)


def test_mfu_rejects_a_non_positive_peak():
    with pytest.raises(ValueError, match="peak"):
        mfu(1.0, 1.0, 0.0)
