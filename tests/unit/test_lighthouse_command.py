"""`kempnerforge lighthouse`: serves until stopped, and refuses bad flags and a port in use
with exit 2."""

from __future__ import annotations

import importlib.util
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.support.replica_groups import free_port, start_lighthouse


def test_a_bad_port_exits_2_naming_the_flag():
    done = subprocess.run(
        [sys.executable, "-m", "kempnerforge", "lighthouse", "--port=70000"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2
    assert "--port = 70000: expected an integer >= 0 and <= 65535" in done.stderr


def test_without_torchft_it_exits_2_naming_the_ft_extra():
    hide_torchft = (
        "import sys; sys.modules['torchft'] = None; from kempnerforge.cli import main; "
        "sys.exit(main(['lighthouse', '--port=0']))"
    )
    done = subprocess.run([sys.executable, "-c", hide_torchft], capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "kempnerforge: error: torchft = None: expected the installed package (the lighthouse "
        "is torchft's) (install the ft extra: pip install 'kempnerforge[ft]')"
    ]


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs the ft extra")
def test_it_serves_its_status_page_and_stops_on_sigterm():
    port = free_port()
    lighthouse = start_lighthouse(port)
    try:
        with urllib.request.urlopen(f"http://localhost:{port}/", timeout=10) as page:
            assert page.status == 200
        lighthouse.send_signal(signal.SIGTERM)
        assert lighthouse.wait(timeout=20) == 0
    finally:
        lighthouse.kill()


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="needs the ft extra")
def test_a_port_in_use_exits_2_with_one_line_naming_it():
    # Held the way the lighthouse binds it (every IPv6 and IPv4 address), so the bind fails
    # whatever the machine's dual-stack setting.
    with socket.socket(socket.AF_INET6) as held:
        held.bind(("::", 0))
        held.listen()
        port = held.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "kempnerforge", "lighthouse", f"--port={port}"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"kempnerforge: error: --port = {port}: expected a port no other process listens on "
        "(it is in use, perhaps by another lighthouse: pick another --port, or --port=0 for "
        "any free one)"
    ]


def test_the_join_timeout_follows_the_groups_median_step_time(tmp_path):
    from kempnerforge.commands.lighthouse import JOIN_TIMEOUT_STEPS, join_timeout_from_run

    assert join_timeout_from_run(str(tmp_path), 1000)[0] == 1000  # no rows yet: the floor
    for group, times in ((0, [0.5, 0.6, 0.7]), (1, [0.4, 2.0])):
        run = tmp_path / f"replica_{group}"
        run.mkdir()
        lines = [
            f'{{"step": {i + 1}, "loss": 1.0, "step_time_s": {t}}}' for i, t in enumerate(times)
        ]
        lines.append('{"step": 3, "event": "replica_rejoined", "group": 1}')
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    chosen, why = join_timeout_from_run(str(tmp_path), 1000)
    assert chosen == round(JOIN_TIMEOUT_STEPS * 0.6 * 1000)  # the median of the five rows
    assert "median step time 0.600 s of 5 rows" in why
    assert join_timeout_from_run(str(tmp_path), 5000)[0] == 5000  # never below the floor
