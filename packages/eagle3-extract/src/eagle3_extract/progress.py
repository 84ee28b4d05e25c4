"""One progress bar over a run's capture, on stderr: samples done of those pending, tokens/s.

Between the dry run and the first shard a large run otherwise prints nothing for minutes. Both
backends feed the same bar: the transformers backend after every forward batch, the vLLM
driver for every request the engine finishes (through ``LLM.generate``'s ``use_tqdm`` hook).
Log lines written meanwhile go through tqdm, so they do not break the bar.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm


class CaptureProgress:
    def __init__(self, samples: int, tokens: int, desc: str = "extract") -> None:
        self.total_tokens = tokens
        self.tokens = 0.0  # float: the vLLM driver credits an estimate per finished request
        self._started = time.perf_counter()
        self._bar = tqdm(
            total=samples, desc=desc, unit="sample", file=sys.stderr, dynamic_ncols=True
        )

    @property
    def samples(self) -> int:
        return int(self._bar.n)

    def advance(self, samples: int, tokens: float) -> None:
        """Count ``samples`` more samples holding ``tokens`` tokens as captured."""
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self._started, 1e-9)
        self._bar.set_postfix_str(
            f"{self.tokens:,.0f}/{self.total_tokens:,} tokens, {rate:,.0f} tokens/s",
            refresh=False,
        )
        self._bar.update(samples)

    def close(self) -> None:
        self._bar.close()


@contextlib.contextmanager
def capture_progress(samples: int, tokens: int) -> Iterator[CaptureProgress]:
    """The bar for the lifetime of the block, with the package's log lines routed around it."""
    progress = CaptureProgress(samples, tokens)
    try:
        with logging_redirect_tqdm():
            yield progress
    finally:
        progress.close()
