"""Preemption signals for the stages' long loops (extract's shards, regenerate's answers).

SIGTERM is what Slurm and Kubernetes send before killing a job; Slurm's ``--signal=USR1@120``
sends SIGUSR1 ahead of time. ``StopSignals`` records the first such signal; the loop checks
``requested`` at a boundary where everything so far is safely on disk, then leaves with
``EXIT_PREEMPTED``. A second signal of the same kind takes its default action (stop now).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

# every stage's exit status for "stopped by a preemption signal; rerun to resume"
EXIT_PREEMPTED = 5


def parse_signals(names: Sequence[str], where: str = "preempt signals") -> list[signal.Signals]:
    """``["SIGTERM", "USR1"]`` as signals; a clear error naming the one that is not."""
    out = []
    for name in names:
        key = name.strip().upper()
        key = key if key.startswith("SIG") else f"SIG{key}"
        try:
            sig = signal.Signals[key]
        except KeyError:
            raise ValueError(
                f"{where}: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{where}: {name} cannot be caught")
        out.append(sig)
    return out


class StopSignals:
    """While installed (``install``/``uninstall``, or as a context manager), the given signals
    are recorded instead of acted on."""

    def __init__(self, names: Sequence[str], where: str = "preempt signals") -> None:
        self.signals = parse_signals(names, where)
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is not None and signum == self.received:
            signal.signal(signum, signal.SIG_DFL)  # asked twice: stop now
            os.kill(os.getpid(), signum)
            return
        self.received = signal.Signals(signum)

    def install(self) -> None:
        """Record the signals from now on (until ``uninstall``)."""
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)

    def uninstall(self) -> None:
        """The handlers found at ``install`` again."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        self.install()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.uninstall()
