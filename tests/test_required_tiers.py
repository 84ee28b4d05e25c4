"""The workspace conftest's EAGLE3_REQUIRE_TIERS hook, run on throwaway test files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"  # placed in tests/
INI = """
[pytest]
markers =
    vllm: vllm tier
    distributed: distributed tier
    tmpfs: tmpfs tier
"""
TESTS = """
import pytest

@pytest.mark.vllm
def test_runs(): pass

@pytest.mark.vllm
def test_skips(): pytest.skip("no vllm python")

@pytest.mark.vllm
def test_expected_failure(): pytest.xfail("known defect")

@pytest.mark.distributed
def test_launch(): pass
"""


@pytest.fixture
def tree(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makeini(INI)
    pytester.makepyfile(test_tiers=TESTS)
    monkeypatch.setenv("EAGLE3_VLLM_PYTHON", "/bin/sh")  # executable: the prerequisite holds
    return pytester


def test_unset_changes_nothing(tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EAGLE3_REQUIRE_TIERS", raising=False)
    assert tree.runpytest("-k", "not skips").ret == 0


def test_a_skip_in_a_required_tier_fails(
    tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "vllm")
    result = tree.runpytest()
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        ["*tier 'vllm': 1 test(s) skipped*", "*test_skips: Skipped: no vllm python*"]
    )


def test_xfail_counts_as_run_and_a_full_tier_passes(
    tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "vllm,distributed")
    assert tree.runpytest("-k", "not skips").ret == 0


def test_a_deselected_tier_fails(tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "vllm,distributed")
    result = tree.runpytest("-m", "not distributed", "-k", "not skips")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*tier 'distributed': no test executed*"])


@pytest.mark.process  # pytest-xdist's workers are processes
def test_the_tally_holds_across_xdist_workers(
    tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI runs the suite on two xdist workers: the controller, which has no items, still counts
    every worker's tests by tier."""
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "vllm,distributed")
    result = tree.runpytest("-n", "2")  # one session: workers start slowly on 2 busy cores
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        ["*tier 'vllm': 1 test(s) skipped*", "*test_skips: Skipped: no vllm python*"]
    )
    result.stdout.no_fnmatch_line("*no test executed*")  # both tiers' tests were counted


def test_missing_vllm_python_is_a_usage_error(
    tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "vllm")
    monkeypatch.delenv("EAGLE3_VLLM_PYTHON")
    result = tree.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*EAGLE3_VLLM_PYTHON is not set*"])


UNTIERED_SKIP = """
import pytest

pytest.importorskip("eagle3_no_such_module")

@pytest.mark.vllm
def test_never_collected(): pass
"""


def test_a_module_skipped_at_collection_fails_a_tiered_run(
    tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module-level importorskip hides its tests before they carry any marker: the guard
    cannot tell their tier, so it counts the skip itself."""
    tree.makepyfile(test_optional=UNTIERED_SKIP)
    monkeypatch.delenv("EAGLE3_REQUIRE_TIERS", raising=False)
    assert tree.runpytest("-k", "not skips").ret == 0  # on a laptop: a skip, as before
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "vllm,distributed")
    result = tree.runpytest("-k", "not skips")
    assert result.ret == 1
    result.stdout.fnmatch_lines(
        [
            "*1 module(s) skipped at collection: their tests' tiers are unknown*",
            "*test_optional.py: *could not import 'eagle3_no_such_module'*",
        ]
    )


FULL_DISK = """
import pytest

from support.smallfs import leave_free, small_tmpfs

@pytest.mark.tmpfs
def test_full_disk(tmp_path):
    with small_tmpfs(tmp_path / "small", size_mib=1) as disk:
        leave_free(disk, 0)
        with pytest.raises(OSError, match="No space left on device"):
            (disk / "more").write_bytes(b"x" * 8192)
"""


@pytest.mark.process
def test_a_machine_that_cannot_mount_a_tmpfs_fails_the_tmpfs_tier_before_any_test(
    tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where ``mount`` is refused (not root), the full-disk tests would skip: a required tmpfs
    tier stops the session as a usage error instead, naming mount's own refusal."""
    tree.makepyfile(test_disk=FULL_DISK)
    refusing = tmp_path / "bin"
    refusing.mkdir()
    (refusing / "mount").write_text("#!/bin/sh\necho 'mount: only root can do that' >&2\nexit 1\n")
    (refusing / "mount").chmod(0o755)
    monkeypatch.setenv("PATH", f"{refusing}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("EAGLE3_REQUIRE_TIERS", raising=False)
    result = tree.runpytest("test_disk.py")
    assert result.ret == 0  # on a laptop: a skip, as before
    result.assert_outcomes(skipped=1)
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "tmpfs")
    result = tree.runpytest("test_disk.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*tier 'tmpfs' is required but cannot mount a 1 MiB tmpfs (needs root): mount: only root*"]
    )


@pytest.mark.tmpfs
def test_the_tmpfs_tier_runs_where_a_tmpfs_mounts(
    tree: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    tree.makepyfile(test_disk=FULL_DISK)
    monkeypatch.setenv("EAGLE3_REQUIRE_TIERS", "tmpfs")
    result = tree.runpytest("test_disk.py")
    assert result.ret == 0
    result.assert_outcomes(passed=1)


QUICK_TESTS = """
import multiprocessing
import os
import subprocess
import sys

import pytest

def test_plain(): pass

def test_runs_a_cli(): subprocess.run([sys.executable, "-c", "pass"], check=True)

def test_spawns_a_worker():
    worker = multiprocessing.get_context("spawn").Process(target=print)
    worker.start()
    worker.join()

def test_forks():
    if os.fork() == 0:
        os._exit(0)

@pytest.mark.process
def test_marked(): pass

@pytest.mark.vllm
def test_engine(): pass
"""


def test_the_quick_tier_selects_unmarked_tests_and_fails_one_that_starts_a_process(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # CI's EAGLE3_REQUIRE_TIERS=tmpfs would make the inner session probe a mount (a process)
    # while this quick test runs: the guard refuses it, as it should.
    monkeypatch.delenv("EAGLE3_REQUIRE_TIERS", raising=False)
    pytester.makeconftest(ROOT_CONFTEST.read_text())
    pytester.makeini(INI + "    process: starts a process\n    quick: the quick tier\n")
    pytester.makepyfile(test_quick=QUICK_TESTS)
    result = pytester.runpytest("-m", "quick")
    result.assert_outcomes(passed=1, failed=3, deselected=2)
    for name in ("test_runs_a_cli", "test_spawns_a_worker", "test_forks"):
        result.stdout.fnmatch_lines(
            [f"*test_quick.py::{name} is in the quick tier but starts another process*"]
        )
