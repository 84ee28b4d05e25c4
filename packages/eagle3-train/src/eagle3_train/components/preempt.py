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

from typing import Any

from eagle3_schemas.runtime.signals import StopSignals


class Preemption:
    """Records the preemption signals (eagle3_schemas.runtime.signals.StopSignals, every stage's
    handler) and tells the loop, on every rank at the same optimizer step, when to checkpoint
    and leave."""

    def __init__(self, signal_names: list[str], accelerator: Any, lag: int) -> None:
        self.signals = StopSignals(signal_names, "train.preempt_signals")
        self.accelerator = accelerator
        self.lag = lag
        self._pending: list[tuple[Any, Any]] = []  # (host tensor, CUDA event)

    def install(self) -> None:
        self.signals.install()

    def uninstall(self) -> None:
        self.signals.uninstall()

    def poll(self) -> bool:
        """Called once per optimizer step on every rank: True when all ranks stop here."""
        import torch

        world = self.accelerator.num_processes
        if world == 1:
            return self.signals.requested
        # made on the device: torch.tensor([...], device=cuda) is a blocking host-to-device copy
        flag = torch.full((1,), float(self.signals.requested), device=self.accelerator.device)
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
        received = self.signals.received
        if received is not None:
            return received.name
        return "a signal to another rank"
