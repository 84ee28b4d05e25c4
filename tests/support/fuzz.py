"""What the fuzz tests share: one hypothesis settings object and a tally of outcomes per reader.

Every reader of user files (ingest, the schema validators, the training config and its
``--set``, a draft's layout, the recipe planner's model folder) is fuzzed by a property in its package's ``test_fuzz_*.py``: each
generated input is accepted, or refused by the reader's own error naming where, never any
other exception. The tests run a bounded, derandomized sample (``EXAMPLES``, 100 by default,
quick tier); ``tools/fuzz/run_fuzz.py`` runs the same tests with ``EAGLE3_FUZZ_EXAMPLES`` set
high and prints ``TALLY``.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

EXAMPLES_ENV = "EAGLE3_FUZZ_EXAMPLES"
EXAMPLES = int(os.environ.get(EXAMPLES_ENV, "100"))

# Derandomized: CI draws the same examples every run, so a failure reproduces as is. The tool
# sets a seed of its own (EAGLE3_FUZZ_SEED) to explore beyond them.
_SEED = os.environ.get("EAGLE3_FUZZ_SEED")
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=_SEED is None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)


def json_of(
    scalars: st.SearchStrategy[Any],
    keys: st.SearchStrategy[str] | None = None,
    max_leaves: int = 5,
) -> st.SearchStrategy[Any]:
    """JSON values built of ``scalars``: lists and objects of up to three entries, nested, up to
    ``max_leaves`` leaves; object keys from ``keys`` (text of up to 5 characters by default)."""
    names = st.text(max_size=5) if keys is None else keys
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(names, inner, max_size=3),
        max_leaves=max_leaves,
    )


# reader -> Counter(examples, accepted, refused, tracebacks)
TALLY: defaultdict[str, Counter[str]] = defaultdict(Counter)

T = TypeVar("T")


def outcome(
    reader: str,
    call: Callable[[], T],
    refusals: tuple[type[BaseException], ...] = (),
    refused: Callable[[T], bool] = lambda result: False,
) -> T | BaseException:
    """Run ``call`` once, counted under ``reader``: its result (accepted, or refused when
    ``refused(result)``: a validator's violations), or the refusal it raised (one of
    ``refusals``, returned for the caller to inspect). Any other exception is a traceback:
    counted, then raised, so the property fails."""
    TALLY[reader]["examples"] += 1
    try:
        result = call()
    except refusals as e:
        TALLY[reader]["refused"] += 1
        return e
    except Exception:
        TALLY[reader]["tracebacks"] += 1
        raise
    TALLY[reader]["refused" if refused(result) else "accepted"] += 1
    return result


def count(reader: str, **counts: int) -> None:
    """Add counts a property measured itself (ingest counts records, not files)."""
    TALLY[reader].update(counts)


def places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a node of a JSON-like value (the spots a fuzz test may damage)."""
    out = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            out += places(child, (*path, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out += places(child, (*path, i))
    return out
