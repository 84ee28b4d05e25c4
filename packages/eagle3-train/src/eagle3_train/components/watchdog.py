"""A dead or frozen rank must not hang the others for half an hour.

The default process group gets train.collective_timeout_s (Accelerate's InitProcessGroupKwargs),
but groups created later without a timeout — DeepSpeed's data-parallel groups, which ZeRO's
reduce-scatter and all-gather use — get torch's default (30 min for gloo, 10 for NCCL). So
each rank also runs this watchdog: a thread that, when no training micro-batch has finished
for ``timeout_s`` while training is under way, logs what happened and ends the process with
the status its ``verdict`` gives (the cause's, where another rank stopped on a fault). Phases
where a rank legitimately waits or works alone (checkpoints, validation, exports) pause it;
their collectives run on the default group, bounded by its timeout.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)


class StepWatchdog:
    def __init__(self, timeout_s: float, verdict: Callable[[float], tuple[int, str]]) -> None:
        self.timeout_s = timeout_s
        self.verdict = verdict  # idle seconds -> (exit status, message), asked when it fires
        self._last = time.monotonic()
        self._armed = False  # set by the first kick: start-up (compilation) is not watched
        self._paused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="eagle3-watchdog", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def kick(self) -> None:
        """A micro-batch finished on this rank."""
        self._last = time.monotonic()
        self._armed = True

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1
            self._last = time.monotonic()

    def _watch(self) -> None:
        interval = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(interval):
            idle = time.monotonic() - self._last
            if self._armed and not self._paused and idle > self.timeout_s:
                status, message = self.verdict(idle)
                log.error("%s", message)
                for handler in logging.getLogger().handlers + log.handlers:
                    handler.flush()
                sys.stderr.flush()
                os._exit(status)  # the main thread is stuck inside a collective
