"""Preemption: a signal (SIGTERM by default, what Slurm and Kubernetes send before a kill;
train.preempt_signals, e.g. SIGUSR1 with Slurm's ``--signal=USR1@120``) asks the run to stop
at the next optimizer-step boundary with a checkpoint.

The handler only records the signal; the loop polls at each optimizer step. Under several
processes the ranks agree with one tiny all-reduce per step (no host sync on CUDA: the result
is copied to the host asynchronously and read ``lag`` steps later, the same step on every
rank), so the signal reaching any one rank stops them all at the same step. A second signal
of the same kind restores the default action and delivers it (stop now, as kill would).
"""

from __future__ import annotations

import os
import signal
from types import FrameType
from typing import Any


def parse_signals(names: list[str]) -> list[signal.Signals]:
    """``["SIGTERM", "USR1"]`` as signals; a clear error naming the unknown one."""
    out = []
    for name in names:
        key = name.upper() if name.upper().startswith("SIG") else f"SIG{name.upper()}"
        try:
            out.append(signal.Signals[key])
        except KeyError:
            raise ValueError(
                f"train.preempt_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)"
            ) from None
        if out[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"train.preempt_signals: {name} cannot be caught")
    return out


class Preemption:
    """Records the preemption signals and tells the loop, on every rank at the same optimizer
    step, when to checkpoint and leave."""

    def __init__(self, signals: list[signal.Signals], accelerator: Any, lag: int) -> None:
        self.signals = signals
        self.accelerator = accelerator
        self.lag = lag
        self.received: signal.Signals | None = None
        self._count = 0
        self._previous: dict[signal.Signals, Any] = {}
        self._pending: list[tuple[Any, Any]] = []  # (host tensor, CUDA event)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._count += 1
        if self.received is not None and signum == self.received and self._count > 1:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: stop now
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum)

    def install(self) -> None:
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def poll(self) -> bool:
        """Called once per optimizer step on every rank: True when all ranks stop here."""
        import torch

        world = self.accelerator.num_processes
        if world == 1:
            return self.received is not None
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.accelerator.device)
        flag = self.accelerator.reduce(flag, reduction="sum")
        if flag.is_cuda:
            host = torch.empty(1, pin_memory=True)
            host.copy_(flag, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flag, None
        self._pending.append((host, event))
        if len(self._pending) <= self.lag:
            return False
        host, event = self._pending.pop(0)
        if event is not None:
            event.synchronize()
        return float(host[0]) > 0

    def describe(self) -> str:
        if self.received is not None:
            return self.received.name
        return "a signal to another rank"
