"""Fuzz every reader of user files at scale and print what each did with its inputs.

Runs the property tests CI runs on a bounded sample (``test_fuzz_*.py`` of each package; the
settings and the tally live in ``tests/support/fuzz.py``) with many more examples and a seed of
its own, in this process, one reader at a time, then prints a table:

    reader | examples | accepted | refused | tracebacks

``tracebacks`` must be 0: a generated input that raised anything but the reader's own named
refusal fails its property (pytest shows the minimal example) and is counted there. For ingest,
``examples`` are input files and accepted/refused count whole files; the records inside them
are counted on the line below (written, rejected by name).

    uv run python tools/fuzz/run_fuzz.py                      # every reader, 10,000 examples each
    uv run python tools/fuzz/run_fuzz.py --reader ingest --examples 2000 --seed 7

On a shared 2-core machine run it under ``nice -n 19``, one reader at a time.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Each reader's property tests, and the name its counts go under in support.fuzz.TALLY.
READERS = {
    "ingest": ("packages/eagle3-data/tests/test_fuzz_ingest.py", "ingest"),
    "validators": ("packages/eagle3-schemas/tests/test_fuzz_validate.py", "validators"),
    "config": ("packages/eagle3-train/tests/test_fuzz_config.py", "train config"),
    "layout": ("packages/eagle3-schemas/tests/test_fuzz_draft_layout.py", "draft layout"),
    "init_from": ("packages/eagle3-train/tests/test_fuzz_init_from.py", "init_from"),
    "recipe": ("packages/eagle3-recipe/tests/test_fuzz_target.py", "recipe planner"),
}
COLUMNS = ("examples", "accepted", "refused", "tracebacks")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reader", choices=sorted(READERS), action="append")
    parser.add_argument("--examples", type=int, default=10_000, help="per property")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    # Read by support.fuzz when pytest imports it below: set before.
    os.environ["EAGLE3_FUZZ_EXAMPLES"] = str(args.examples)
    os.environ["EAGLE3_FUZZ_SEED"] = str(args.seed)
    os.chdir(REPO)
    import pytest

    statuses, seconds = {}, {}
    for reader in args.reader or list(READERS):
        start = time.monotonic()
        statuses[reader] = pytest.main(
            [READERS[reader][0], "-q", "-p", "no:cacheprovider", f"--hypothesis-seed={args.seed}"]
        )
        seconds[reader] = time.monotonic() - start
    from support.fuzz import TALLY  # the module pytest imported (tests/ is on its pythonpath)

    print(f"\n{'reader':30} " + " ".join(f"{c:>10}" for c in COLUMNS) + f" {'seconds':>8}")
    for reader, took in seconds.items():
        for name, tally in TALLY.items():
            if not name.startswith(READERS[reader][1]):
                continue
            cells = " ".join(f"{tally[c]:>10}" for c in COLUMNS)
            print(f"{name:30} {cells} {took:>8.0f}")
            if "records" in tally:
                print(
                    f"{'  records in those files':30} {tally['records']:>10} "
                    f"{tally['written']:>10} {tally['rejected']:>10}   (read, written, refused)"
                )
    failed = [r for r, status in statuses.items() if status != 0]
    if failed:
        print(f"failed: {', '.join(failed)} (see pytest's report above)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
