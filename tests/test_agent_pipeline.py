"""The agent recipe's pipeline, chained: `recipes/tiny-agent/pipeline.sh` on the embedded target
that thinks and calls tools in Kimi-K2.5's chat format, gated by vLLM on each kind of traffic.

- Quality gate: vLLM's acceptance length at k = 3 (greedy) on the held-out thinking prompts is
  >= 2.6. Measured with the recipe's defaults (every row of the corpus's mix, 150 steps), seeds
  0 / 1 / 2: 2.973 / 2.992 / 2.965 on 20 thinking prompts (about 260 drafts each, standard error
  ~0.07); the floor is 5 standard errors below. A draft trained on instant answers alone reads
  1.180 / 1.141 / 1.168 there (tools/bench/bench_traffic_mix.sh): below the floor, as shown
  once with that draft planted in the pipeline's folder.
- Every kind is measured: the 60 held-out prompts split 14 instant / 20 thinking / 26 agent (tools
  declared; some after a tool result), each kind's figures in the report and printed.
- Speculative decoding is lossless at temperature 0 on every kind, tool calls included: vLLM's
  greedy tokens with the draft equal the target's alone.
- The draft trained on the traffic it is measured on: the tokenized training set holds samples
  of each kind (reasoning inside <think>, tool calls), the draft's lineage is that set's, and it
  took the pipeline's STEPS (a draft of instant rows alone stopped at 96 of 150 steps, its 4
  epochs, before pipeline.sh set the epochs from STEPS).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from eagle3_schemas import read_header
from eagle3_schemas.contract.lineage import fingerprint_artifact

from support.pipeline_runs import cached_run

# The pipeline takes ~3.5 min on 2 idle cores: room for a busy machine.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "tiny-agent"
THINKING_FLOOR, K = 2.6, 3
STEPS = 150  # pipeline.sh's default
PROMPTS = 60
PROMPTS_PER_KIND = {"instant": 14, "thinking": 20, "agent": 26}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, vllm_python: str) -> Iterator[tuple[Path, str]]:
    """The recipe's whole run, kept between sessions by its content (support.pipeline_runs)."""
    fallback = tmp_path_factory.mktemp("agent-pipeline")
    with cached_run("tiny-agent", {"PROMPTS": str(PROMPTS)}, vllm_python, fallback) as (
        out,
        printed,
    ):
        yield out, printed["stdout"]


def _report(out: Path) -> dict:
    return json.loads((out / "eval-vllm" / "report.json").read_text())


def test_vllm_measured_acceptance_on_thinking_traffic_passes_the_gate(
    run: tuple[Path, str],
) -> None:
    out, printed = run
    report = _report(out)
    assert report["mode"] == "vllm" and report["num_speculative_tokens"] == K
    assert report["temperature"] == 0.0 and report["counter_check"]["agree"]
    kinds = {g["kind"]: g for g in report["kinds"]}
    thinking = kinds["thinking"]
    assert THINKING_FLOOR <= thinking["acceptance_length"] <= K + 1, thinking
    line = (
        f"vLLM-measured acceptance length on thinking traffic: {thinking['acceptance_length']:.3f}"
    )
    assert line in printed


def test_every_kind_of_traffic_is_measured_and_printed(run: tuple[Path, str]) -> None:
    out, printed = run
    report = _report(out)
    assert report["num_prompts"] == PROMPTS
    kinds = {g["kind"]: g for g in report["kinds"]}
    assert {k: g["num_prompts"] for k, g in kinds.items()} == PROMPTS_PER_KIND
    for kind, g in kinds.items():
        assert g["num_drafts"] > 0 and 1 <= g["acceptance_length"] <= K + 1, g
        assert f"acceptance length on {kind} traffic: {g['acceptance_length']:.3f}" in printed
    # The kinds partition the prompts: their drafts add up to the whole run's.
    assert sum(g["num_drafts"] for g in kinds.values()) == report["num_drafts"]


def test_greedy_outputs_with_the_draft_equal_the_target_alone_on_every_kind(
    run: tuple[Path, str],
) -> None:
    out = run[0]
    assert _report(out)["outputs_identical_to_baseline"] == {
        "compared": PROMPTS,
        "identical": PROMPTS,
    }
    samples = pq.read_table(out / "eval-vllm" / "samples.parquet").to_pylist()
    assert sorted({s["kind"] for s in samples}) == sorted(PROMPTS_PER_KIND)


def test_the_draft_trained_on_instant_answers_reasoning_and_tool_calls(
    run: tuple[Path, str],
) -> None:
    """What the loss covers: instant answers (no </think> in the completion; the prompt closed
    an empty <think></think>), reasoning closed by </think>, and tool calls."""
    from transformers import AutoTokenizer

    out = run[0]
    tokenizer = AutoTokenizer.from_pretrained(RECIPE / "target")
    think_end, call = tokenizer.convert_tokens_to_ids(["</think>", "<|tool_call_begin|>"])
    samples = pq.read_table(out / "train.tokenized.parquet", columns=["input_ids", "loss_mask"])
    counts = {"instant": 0, "reasoning": 0, "tool call": 0}
    for s in samples.to_pylist():
        completion = [
            i for i, trained in zip(s["input_ids"], s["loss_mask"], strict=True) if trained
        ]
        counts["instant"] += think_end not in completion
        counts["reasoning"] += think_end in completion[1:]
        counts["tool call"] += call in completion
    assert all(n > 0 for n in counts.values()), counts
    # STEPS steps taken (the recipe's 4 epochs alone stop a small training set short of them).
    events = [
        json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [e["step"] for e in events if e["event"] == "done"] == [STEPS]
    trained = read_header(out / "train" / "draft").lineage
    dataset = read_header(out / "hidden_states").lineage
    assert trained["hidden_states_fingerprint"] == fingerprint_artifact(out / "hidden_states")
    assert dataset["tokenized_fingerprint"] == fingerprint_artifact(out / "train.tokenized.parquet")
