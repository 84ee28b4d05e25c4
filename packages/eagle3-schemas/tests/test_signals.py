"""StopSignals, every stage's preemption handler (the trainer's Preemption wraps it): a signal
is recorded while installed, the previous handler is back once uninstalled, and a second
signal of the same kind takes its default action."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from eagle3_schemas.runtime.signals import StopSignals


def _handler_seen_by(stop: StopSignals) -> None:
    assert not stop.requested
    os.kill(os.getpid(), signal.SIGUSR1)  # delivered before kill returns (to this thread)
    assert stop.requested and stop.received == signal.SIGUSR1


def test_install_records_the_signal_and_uninstall_restores_the_previous_handler():
    seen: list[int] = []

    def ours(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR1, ours)
    try:
        stop = StopSignals(["USR1"], "train.preempt_signals")
        stop.install()
        try:
            _handler_seen_by(stop)
        finally:
            stop.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is ours
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1]  # the handler found at install, not StopSignals'
        with StopSignals(["SIGUSR1"]) as again:  # the context manager: the same two steps
            _handler_seen_by(again)
        assert signal.getsignal(signal.SIGUSR1) is ours
        os.kill(os.getpid(), signal.SIGUSR1)
        assert seen == [signal.SIGUSR1, signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.process
def test_a_second_signal_of_the_same_kind_stops_now():
    script = (
        "import os, signal\n"
        "from eagle3_schemas.runtime.signals import StopSignals\n"
        "stop = StopSignals(['SIGUSR1'])\n"
        "stop.install()\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('first recorded:', stop.received.name, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGUSR1)\n"
        "print('still running', flush=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == -signal.SIGUSR1, result.stderr
    assert result.stdout == "first recorded: SIGUSR1\n"
