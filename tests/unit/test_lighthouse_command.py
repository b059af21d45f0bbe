"""`kempnerforge lighthouse`: serves until stopped, and refuses bad flags with exit 2."""

from __future__ import annotations

import importlib.util
import signal
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
