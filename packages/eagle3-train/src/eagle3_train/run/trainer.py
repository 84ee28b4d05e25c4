"""Training under Accelerate (single process, DDP, DeepSpeed ZeRO-2/3): set up, run, close.

``train`` composes the components in named steps: ``start_accelerator``
(components/accelerator.py) → ``load_and_check_inputs`` (run/setup.py, preflight/) →
``prepare_output_dir`` → ``set_up_run`` (model, optimizer and schedule from
components/build.py, the data order, resume, trackers) → ``Loop`` (run/loop.py):
``run_epochs`` over segments and micro-batches, with validation (run/validation.py),
checkpoints (components/checkpoint.py), metrics (components/metrics.py) and the non-finite
watch (run/nonfinite.py) → ``finish`` (last validation and checkpoint, final export and
publication: run/deliver.py). What stops a run maps to its exit status in
components/faults.py. Distribution is applied from outside (accelerate.prepare); the model
knows nothing of it.

Files under ``output_dir``:
  run.yaml                 the resolved config of this run
  metrics.jsonl            one JSON line per logged step / validation (main process)
  checkpoints/step-N/      resumable state: model, optimizer, RNG (accelerate.save_state),
                           trainer_state.json (step, data position, scheduler, best);
                           written as .tmp-step-N and renamed when complete
  checkpoints/latest.json  the newest complete checkpoint
  exports/step-N/          speculators-format drafts (validated exports at evaluations)
  draft/                   the deliverable: the best export (or the last without validation)
  faults/rank-R.json       several ranks: what stopped rank R (exit status, message), for
                           the others to exit with (causes.py); removed when R starts again
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from eagle3_train.components.accelerator import deepspeed_refusals, start_accelerator
from eagle3_train.components.causes import clear_record
from eagle3_train.components.faults import EXIT_PREFLIGHT
from eagle3_train.config.run_config import Config
from eagle3_train.run.loop import Loop
from eagle3_train.run.setup import load_and_check_inputs, prepare_output_dir, set_up_run

log = logging.getLogger(__name__)


def train(config: Config, preflight_only: bool = False) -> int:
    """Run (or only preflight) training; returns the process exit code."""
    cleanup: list[Callable[[], None]] = []  # signal handlers and the watchdog, when started
    try:
        return _train(config, preflight_only, cleanup)
    finally:
        for undo in cleanup:
            undo()


def _train(config: Config, preflight_only: bool, cleanup: list[Callable[[], None]]) -> int:
    run_started = time.perf_counter()
    refused = deepspeed_refusals(config)
    for message in refused:
        log.error(message)
    if refused:
        return EXIT_PREFLIGHT
    # an earlier attempt's fault record of this rank goes before the ranks meet (causes.py)
    clear_record(config.output_dir, int(os.environ.get("RANK", "0")))
    accelerator = start_accelerator(config, preflight_only)
    checked = load_and_check_inputs(config, accelerator, preflight_only)
    if isinstance(checked, int):
        return checked
    if preflight_only:
        return 0
    prepare_output_dir(config, accelerator)
    run = set_up_run(accelerator, *checked, run_started)
    if run is None:
        return EXIT_PREFLIGHT
    loop = Loop(run, cleanup)
    loop.run_epochs()
    return loop.finish()
