"""support.pipeline_runs keys a kept pipeline run by the files that make it: of the test support,
only what the run imports."""

from __future__ import annotations

from support import pipeline_runs


def test_a_run_is_keyed_by_the_support_it_runs_not_by_the_tests_helpers() -> None:
    files = pipeline_runs.support_files("tiny-agent")
    assert "tests/support/pipeline_runs.py" in files  # makes the run
    assert "tests/support/agent_corpus.py" in files  # run by the recipe's flags.sh
    assert "tests/support/tiny_target.py" in files  # imported by the target builders
    assert "tests/support/mt_bench.py" in files  # imported by pipeline_runs: the BENCH file
    assert "tests/support/failures.py" in files
    assert "tests/support/kimi_standin_files/chat_template.jinja" in files  # data
    assert "tests/support/fake_cuda.py" not in files  # the dry-run tier's helper
    assert "tests/support/tiny_draft.py" not in files  # eval's assets, keyed on their own
