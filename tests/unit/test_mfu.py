"""peak_flops_per_sec table and fallbacks, and the MFU ratio."""

from __future__ import annotations

import logging

import pytest
import torch

from kempnerforge.metrics import mfu as mfu_module
from kempnerforge.metrics.mfu import mfu, peak_flops_per_sec


class ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def warnings_seen():
    """WARNING records of the kempnerforge loggers, whatever configure_logging did before."""
    handler = ListHandler()
    root = logging.getLogger("kempnerforge")
    root.addHandler(handler)
    yield handler.records
    root.removeHandler(handler)


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
