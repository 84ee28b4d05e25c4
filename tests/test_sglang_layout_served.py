"""Proof by a real engine: vLLM serves the speculators and the SpecForge / SGLang layouts of the
same trained draft alike, token for token (issue 46).

The draft is eval's trained tiny draft (tests/support/tiny_draft.py, cached across sessions).
Its SGLang layout is made by hand as SpecForge writes it (tests/support/sglang_layout.py: aux
ids in SGLang's counting under ``eagle_config`` only, as lightseekorg/kimi-k2.5-eagle3 has
them; layer 0 as ``midlayer.*``), not by our exporter, so the conversion under test
(eagle3_schemas.layouts.draft_layout, through eval's vllm mode) is held to SGLang's source. vLLM
(0.32 here) loads ``LlamaForCausalLMEagle3`` natively (its registry maps it to
``Eagle3LlamaForCausalLM``, whose loader renames ``midlayer.`` to ``layers.0.``) but reads the
aux ids as they are, in its own counting: served as is, an SGLang draft is fed the layers one
below those it was trained on. eval's vllm mode serves it through a view whose config states
the converted ids (draft_spec.vllm_view). Both layouts run in one eval (one engine each, greedy,
no baseline): every prompt's output tokens and accepted counts per position must be equal, so
both acceptance-length definitions are equal too. An off-by-one planted in the conversion
feeds the draft other layers and changes them (measured: see the report of issue 46).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eagle3_eval.cli import main
from eagle3_eval.report import read_report

from support import tiny_draft
from support.sglang_layout import sglang_copy

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "recipes" / "tiny" / "target"
LIMIT, MAX_NEW_TOKENS = 8, 48


@pytest.fixture(scope="module")
def assets() -> Path:
    """eval's tiny assets (trained draft, corpus), built once per content key and reused."""
    out = Path(tiny_draft.run_fresh("--print-dir", capture=True).strip())
    if not out.is_dir():
        tiny_draft.run_fresh()
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, vllm_python: str, assets: Path) -> Path:
    tmp = tmp_path_factory.mktemp("layouts")
    sglang = sglang_copy(assets / "draft", tmp / "draft-sglang")
    config = json.loads((sglang / "config.json").read_text())
    assert "eagle_aux_hidden_state_layer_ids" not in config  # SpecForge's form: eagle_config only
    out = tmp / "eval"
    argv = ["vllm", "--target", str(TARGET), "--prompts", f"heldout={assets / 'corpus.jsonl'}"]
    argv += ["--heldout-sources", str(TARGET / "build_info.json")]
    argv += ["--limit", str(LIMIT), "--max-new-tokens", str(MAX_NEW_TOKENS)]
    argv += ["--draft", f"speculators={assets / 'draft'}", "--draft", f"sglang={sglang}"]
    argv += ["--out", str(out), "--vllm-python", vllm_python, "--temperature", "0"]
    argv += ["--no-baseline", "--no-card", "--no-figure"]
    assert main(argv) == 0
    return out


def test_vllm_serves_both_layouts_of_one_draft_alike(served: Path) -> None:
    ours = read_report(served / "speculators")
    theirs = read_report(served / "sglang")
    a = {r["sample_id"]: r for r in ours.samples.to_pylist()}
    b = {r["sample_id"]: r for r in theirs.samples.to_pylist()}
    assert a.keys() == b.keys() and len(a) == LIMIT
    for sid in a:
        assert a[sid]["output_token_ids"] == b[sid]["output_token_ids"], sid
        assert a[sid]["accepted_per_position"] == b[sid]["accepted_per_position"], sid
        assert a[sid]["num_drafts"] == b[sid]["num_drafts"], sid
    for key in ("acceptance_length", "acceptance_length_per_request", "num_drafts"):
        assert ours.fields[key] == theirs.fields[key], key
    assert ours.fields["acceptance_length"] > 1.6  # a trained draft, not two equal failures
    print(
        f"AL pooled {ours.fields['acceptance_length']:.4f}, per-request mean "
        f"{ours.fields['acceptance_length_per_request']:.4f} (both layouts)"
    )
    notes = " ".join(theirs.fields.get("notes") or [])
    assert "sglang layout" in notes and "[1, 2, 4] in SGLang" in notes
    table = json.loads((served / "table.json").read_text())
    rows = {row["draft"]: row["cells"]["all"] for row in table["rows"]}
    assert rows["speculators"] == rows["sglang"]
    assert "per-request mean" in (served / "table.md").read_text()
