"""The warm launcher's commands print, exit and die by signals as fresh `python -m
kempnerforge` processes do; the launches it cannot make alike go to a fresh interpreter."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys

import pytest

from tests.support import warm_process
from tests.support.warm_process import WarmProcess, needs_fresh_interpreter

pytestmark = pytest.mark.slow

REPO = pathlib.Path(__file__).parents[2]
KEMPNERFORGE = [sys.executable, "-m", "kempnerforge"]


def _prepare_from(fifo: pathlib.Path, output: pathlib.Path) -> list[str]:
    """prepare-data of a FIFO: the command blocks in opening it until the test writes."""
    return [*KEMPNERFORGE, "prepare-data", "--input", str(fifo), "--output", str(output)]


@pytest.mark.parametrize("args", [["no-such-command"], ["train", "{tmp}"]])
def test_a_user_error_prints_and_exits_as_in_a_fresh_interpreter(args, tmp_path):
    argv = [*KEMPNERFORGE, *(a.format(tmp=tmp_path) for a in args)]
    fresh, warm = (
        launch(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        for launch in (subprocess.run, warm_process.run)
    )
    assert warm.returncode == fresh.returncode == 2
    assert (warm.stdout, warm.stderr) == (fresh.stdout, fresh.stderr)


def test_a_command_writes_to_its_pipes_and_exits_0_as_in_a_fresh_interpreter(tmp_path):
    fifo = tmp_path / "docs.txt"
    os.mkfifo(fifo)
    outputs = []
    for name, launch in (("fresh", subprocess.Popen), ("warm", warm_process.popen)):
        argv = [*_prepare_from(fifo, tmp_path / name), "--no-progress"]
        proc = launch(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert isinstance(proc, WarmProcess) == (name == "warm")
        fifo.write_text("one document\n")  # returns once the command has opened it
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.replace(str(tmp_path / name), "OUT"))
    assert outputs[0] == outputs[1]
    assert outputs[1].startswith("prepared ")


def test_a_command_leads_its_own_group_and_dies_by_the_signal_sent_to_it(tmp_path):
    fifo = tmp_path / "never.txt"
    os.mkfifo(fifo)  # nobody writes: the command waits until it is signalled
    proc = warm_process.popen(
        _prepare_from(fifo, tmp_path / "out"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    assert isinstance(proc, WarmProcess)
    assert os.getpgid(proc.pid) == proc.pid
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=0.5)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM
    assert out == b""


def test_variables_read_at_start_send_a_command_to_a_fresh_interpreter():
    server = {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert not needs_fresh_interpreter({**server, "KEMPNERFORGE_CACHE": "/c"}, server)
    assert not needs_fresh_interpreter({**server, "OMP_NUM_THREADS": "2"}, server)
    assert not needs_fresh_interpreter({**server, "PYTHONPATH": "/r"}, server)
    for name in ("PYTHONHASHSEED", "TORCH_LOGS", "MKL_NUM_THREADS", "LD_PRELOAD", "LANG"):
        assert needs_fresh_interpreter({**server, name: "x"}, server), name
    assert needs_fresh_interpreter({"PATH": "/bin"}, {**server, "LC_ALL": "C"})
    kept = warm_process.popen([*KEMPNERFORGE, "--help"], stdout=subprocess.DEVNULL)
    fresh = warm_process.popen(
        [*KEMPNERFORGE, "--help"],
        env={**os.environ, "PYTHONHASHSEED": "1"},
        stdout=subprocess.DEVNULL,
    )
    assert isinstance(kept, WarmProcess) and isinstance(fresh, subprocess.Popen)
    assert kept.wait(timeout=60) == fresh.wait(timeout=60) == 0
