"""The report artifact: validates, the PNG renders, the table and the comparison read right."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import matplotlib.image
import pytest

from eagle3_eval.acceptance import SampleCounts, summarize
from eagle3_eval.cli import main
from eagle3_eval.groups import timed_per_sample
from eagle3_eval.plot import DPI, HEIGHT_INCHES, WIDTH_INCHES
from eagle3_eval.report import (
    Baseline,
    EvalResult,
    ReportError,
    compare_table,
    format_table,
    read_report,
    write_report,
)
from eagle3_schemas.contract.validate import validate

from support.fixtures import fake_fingerprint

LINEAGE = {
    "draft_fingerprint": fake_fingerprint("draft"),
    "target_fingerprint": fake_fingerprint("target"),
    "prompts_fingerprint": fake_fingerprint("prompts"),
}


def make_result(
    accepted: list[list[int]],
    tps: float = 30.0,
    temperature: float = 0.0,
    groups: list[tuple[str, str | None]] | None = None,
) -> EvalResult:
    """Sample i draws ``accepted[i]`` per step and belongs to ``groups[i]`` (default: one set)."""
    samples = []
    for i, per_step in enumerate(accepted):
        counts = SampleCounts(f"p{i}", 3, num_generated_tokens=sum(per_step) + len(per_step))
        for a in per_step:
            counts.observe(3, a)
        counts.seconds = 1.0
        counts.output_token_ids = list(range(counts.num_generated_tokens))
        prompt_set, category = groups[i] if groups else ("heldout", None)
        counts.extra.update(source=f"file{i}.py", prompt_set=prompt_set, category=category)
        samples.append(counts)
    baseline = Baseline(
        tokens_per_second=20.0,
        per_sample={
            s.sample_id: (s.num_generated_tokens, 1.5, s.output_token_ids) for s in samples
        },
        group_seconds={key: 1.5 * value for key, value in timed_per_sample(samples).items()},
    )
    seconds = timed_per_sample(samples)
    return EvalResult(
        group_seconds=seconds,
        mode="reference",
        summary=summarize(samples, 3),
        samples=samples,
        temperature=temperature,
        engine={"name": "transformers", "versions": {"torch": "x"}},
        lineage=LINEAGE,
        tokens_per_second=tps,
        baseline=baseline,
        extra={
            "prompts": {
                "held_out_by": "split == 'heldout'",
                "fingerprint": LINEAGE["prompts_fingerprint"],
            }
        },
    )


def test_report_validates_and_the_figure_renders(tmp_path: Path) -> None:
    out = write_report(make_result([[3, 1, 0], [2, 2]]), tmp_path / "report")
    assert validate(out) == []
    report = read_report(out)
    f = report.fields
    assert f["acceptance_length"] == pytest.approx(2.6)
    assert f["speedup"] == pytest.approx(1.5)
    assert f["outputs_identical_to_baseline"] == {"identical": 2, "compared": 2}
    assert report.samples.column("accepted_per_position").to_pylist() == [[2, 1, 1], [2, 2, 0]]
    image = matplotlib.image.imread(out / "acceptance.png")
    assert image.shape[:2] == (HEIGHT_INCHES * DPI, WIDTH_INCHES * DPI)
    assert image.std() > 0.05  # something was drawn


def test_terminal_table(tmp_path: Path) -> None:
    out = write_report(make_result([[3, 1, 0], [2, 2]]), tmp_path / "report")
    table = format_table(read_report(out))
    assert "acceptance length    2.600   (1 + 8 accepted / 5 drafts)" in table
    assert "per position         0.800  0.600  0.200" in table
    assert "speedup 1.50" in table
    assert "greedy outputs equal to baseline: 2/2" in table


def test_compare_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = write_report(make_result([[0, 0, 1]], tps=20.0), tmp_path / "a")
    b = write_report(make_result([[3, 1, 0], [2, 2]]), tmp_path / "b")
    table = compare_table(read_report(a), read_report(b))
    row = next(line for line in table.splitlines() if line.startswith("acceptance length"))
    assert row.split() == ["acceptance", "length", "1.333", "2.600", "1.267"]
    assert main(["compare", str(a), str(b)]) == 0
    assert "position 2" in capsys.readouterr().out
    assert main(["report", str(b)]) == 0


def test_inconsistent_report_is_never_published(tmp_path: Path) -> None:
    result = make_result([[3, 1, 0]])
    wrong = dataclasses.replace(result.summary, num_accepted_tokens=99)
    with pytest.raises(ReportError, match="acceptance_length"):
        write_report(dataclasses.replace(result, summary=wrong), tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary left behind either


def test_existing_directory_is_not_overwritten(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    with pytest.raises(FileExistsError):
        write_report(make_result([[1]]), tmp_path / "r")


def test_figures_per_set_and_category(tmp_path: Path) -> None:
    """Each set and each category of a set adds up its own samples' counts (vLLM's way, not a
    mean of per-sample lengths); speedup compares its own samples' times."""
    accepted = [[3, 3], [0, 0, 0, 0], [1], [2, 2, 2]]
    groups = [("mt", "coding"), ("mt", "writing"), ("mt", "coding"), ("gsm8k", None)]
    out = write_report(make_result(accepted, groups=groups), tmp_path / "report")
    assert validate(out) == []
    report = read_report(out)
    by = {(g["prompt_set"], g["category"]): g for g in report.groups}
    assert list(by) == [("mt", None), ("mt", "coding"), ("mt", "writing"), ("gsm8k", None)]
    assert by[("mt", "coding")]["acceptance_length"] == pytest.approx(1 + 7 / 3)
    assert by[("mt", "coding")]["per_position_acceptance"] == pytest.approx([1, 2 / 3, 2 / 3])
    assert by[("mt", "writing")]["acceptance_length"] == 1.0
    assert (by[("mt", None)]["num_prompts"], by[("mt", None)]["num_drafts"]) == (3, 7)
    assert by[("mt", None)]["acceptance_length"] == pytest.approx(1 + 7 / 7)
    assert by[("gsm8k", None)]["acceptance_length"] == pytest.approx(3.0)
    # 1.5 s per sample without the draft, 1 s with it: each group's speedup is 1.5
    assert {round(g["speedup"], 6) for g in report.groups} == {1.5}
    assert report.samples.column("category").to_pylist() == ["coding", "writing", "coding", None]
    table = format_table(report)
    assert "    mt/coding                2       3  3.333   1.00 0.67 0.67       1.50" in table
    assert "    gsm8k                    1       3  3.000" in table


def test_a_v1_report_still_validates_and_reads_as_one_group(tmp_path: Path) -> None:
    from support.edits import rewrite_header

    out = write_report(make_result([[3, 1, 0], [2, 2]]), tmp_path / "report")

    def as_v1(header: dict) -> None:
        header["schema_version"] = 1
        del header["groups"]

    rewrite_header(out, as_v1)
    assert validate(out) == []
    [whole] = read_report(out).groups
    assert whole["acceptance_length"] == pytest.approx(2.6) and whole["num_prompts"] == 2


def test_a_full_disk_rendering_the_figure_exits_7_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A full disk while (re)writing a report's file was a DiskFull traceback, exit 1; every
    stage stops on a full disk with exit 7, naming the file, and keeps the old file whole."""
    import errno

    from support.iofaults import failing, leftovers

    out = write_report(make_result([[3, 1, 0], [2, 2]]), tmp_path / "report")
    figure = (out / "acceptance.png").read_bytes()
    capsys.readouterr()
    with failing(monkeypatch, 0, errno.ENOSPC) as seen:  # the new figure's fsync
        assert main(["report", str(out), "--figure"]) == 7
    assert seen == ["fsync"]
    err = capsys.readouterr().err
    assert f"eagle3-eval report: disk full: {out / 'acceptance.png'}: no room for" in err, err
    assert (out / "acceptance.png").read_bytes() == figure and not leftovers(tmp_path)
