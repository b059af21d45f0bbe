"""ShutdownHandler: signals become a flag, repeats are harmless, old handlers come back."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from kempnerforge.resilience.shutdown import ShutdownHandler


def test_sigusr1_sets_requested_with_the_signal_name():
    with ShutdownHandler() as handler:
        assert not handler.requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert handler.requested
        assert handler.signal_name == "SIGUSR1"
        assert handler.reason == "SIGUSR1"


def test_a_second_signal_is_recorded_and_does_not_raise():
    with ShutdownHandler() as handler:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
    assert handler.signal_name == "SIGTERM"
    assert handler.signals_received == ("SIGTERM", "SIGTERM", "SIGINT")


def test_sigint_does_not_raise_keyboard_interrupt_while_installed():
    with ShutdownHandler() as handler:
        os.kill(os.getpid(), signal.SIGINT)
    assert handler.signal_name == "SIGINT"


def test_uninstall_restores_the_previous_handler():
    seen = []

    def previous(signum, frame):
        seen.append(signum)

    old = signal.signal(signal.SIGUSR1, previous)
    old_sigint = signal.getsignal(signal.SIGINT)
    try:
        handler = ShutdownHandler()
        handler.install()
        assert signal.getsignal(signal.SIGUSR1) is not previous
        handler.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is previous
        assert signal.getsignal(signal.SIGINT) is old_sigint
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]
        assert not handler.requested
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_request_stops_without_a_signal():
    handler = ShutdownHandler()
    handler.request("rank 3 was preempted")
    assert handler.requested
    assert handler.signal_name is None
    assert handler.reason == "rank 3 was preempted"


def test_install_outside_the_main_thread_raises():
    errors = []

    def install():
        try:
            ShutdownHandler().install()
        except RuntimeError as e:
            errors.append(str(e))

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert errors and "main thread" in errors[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_only_listed_signals_are_caught(sig):
    handler = ShutdownHandler(signals=(signal.SIGUSR2,))
    with handler:
        assert signal.getsignal(sig) is not handler._on_signal
        assert signal.getsignal(signal.SIGUSR2) == handler._on_signal
