"""Why a save failed, told in one line: a full disk named as such, with the bytes free."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kempnerforge.checkpoint.failures import bytes_free, diagnose
from tests.support.small_disks import on_small_disks, require_small_disks

REPO = Path(__file__).parents[2]


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_torchs_unexpected_pos_on_a_full_disk_is_named_a_full_disk(tmp_path):
    # /dev/full fails every write with ENOSPC, and torch's writer reports only the short
    # write ("unexpected pos"), keeping the OS error as the exception's context.
    full = open("/dev/full", "wb")  # noqa: SIM115 (closed below, where it fails again)
    with pytest.raises(RuntimeError) as raised:
        torch.save(torch.zeros(1 << 20), full)
    with contextlib.suppress(OSError):
        full.close()
    assert "unexpected pos" in str(raised.value)
    diagnosis = diagnose(raised.value, tmp_path)
    assert diagnosis.firsthand and isinstance(diagnosis.bytes_free, int)
    assert diagnosis.reason == (
        f"the disk is full: {diagnosis.bytes_free} bytes free on the file system of "
        f"{tmp_path} (RuntimeError: {raised.value} (ENOSPC: No space left on device))"
    )


def test_an_error_that_is_no_full_disk_is_told_as_it_is(tmp_path):
    error = PermissionError(13, "Permission denied", str(tmp_path / "step_2.tmp"))
    diagnosis = diagnose(error, tmp_path)
    assert diagnosis.bytes_free is None
    assert diagnosis.reason == f"PermissionError: [Errno 13] Permission denied: '{error.filename}'"


def test_bytes_free_is_read_from_the_nearest_existing_parent(tmp_path):
    assert bytes_free(tmp_path / "not" / "yet") == bytes_free(tmp_path) > 0


SAVE_ON_A_SMALL_DISK = textwrap.dedent(
    """
    import sys
    import torch
    from kempnerforge.checkpoint.manager import CheckpointManager
    from kempnerforge.config.checkpoint import CheckpointConfig
    from kempnerforge.core.errors import CheckpointError

    directory, mode = sys.argv[1], sys.argv[2]
    manager = CheckpointManager(CheckpointConfig(async_mode=mode), directory)
    model = torch.nn.Linear(256, 256)  # 263 KB of weights, 790 KB with AdamW's moments
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    try:
        manager.save(2, model=model, optimizer=optimizer, scheduler=scheduler, train_state={})
        manager.wait()
    except CheckpointError as error:
        print(error)
    """
)


def _on_a_small_file_system(tmp_path: Path, mode: str) -> subprocess.CompletedProcess:
    """Save into a 512 KB tmpfs mounted in a mount namespace of its own."""
    mount = tmp_path / "small"
    mount.mkdir()
    script = tmp_path / "save.py"
    script.write_text(SAVE_ON_A_SMALL_DISK)
    command = [sys.executable, str(script), str(mount / "ckpt"), mode]
    return subprocess.run(
        on_small_disks({mount: "size=512k"}, command),
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_a_save_on_a_full_file_system_names_the_full_disk(tmp_path, mode):
    require_small_disks()
    done = _on_a_small_file_system(tmp_path, mode)
    assert done.returncode == 0, done.stderr
    directory = tmp_path / "small" / "ckpt"
    what = "the background write of" if mode == "async" else "writing"
    message = done.stdout.strip()
    prefix = (
        f"{directory}: {what} checkpoint step_2 into {directory / 'step_2.tmp'} failed, so it "
        "was not committed (the disk is full: "
    )
    assert message.startswith(prefix), message
    free = int(message[len(prefix) :].split()[0])
    assert free < 512 * 1024
    assert f"bytes free on the file system of {directory} (rank 0: " in message
    assert message.endswith("); no earlier checkpoint exists")
