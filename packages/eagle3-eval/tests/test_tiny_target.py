"""The eval modes on the embedded tiny target: an untrained draft scores ~1, a trained one more.

The fast test builds an untrained draft in seconds. The slow ones use the trained draft of
tests/support/tiny_draft.py (built once into a cache folder keyed by the content of what builds
it; ~5 minutes the first time) and its held-out prompts and hidden states.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3_eval.cli import main
from eagle3_eval.draft_spec import DraftSpec
from eagle3_eval.report import read_report
from eagle3_schemas.contract.header import make_header
from eagle3_schemas.contract.lineage import (
    fingerprint_json,
    fingerprint_model_dir,
    fingerprint_tokenizer_dir,
    fingerprint_vocab_map,
)
from eagle3_schemas.contract.validate import validate

from support import tiny_draft as builder
from support.drafts import random_draft, save_draft, speculators_config

PROMPTS = [
    "Write a Python function `clamp(x, lo, hi)` that does this: limit x to the range [lo, hi].",
    "Write a Python function `is_even(n)` that does this: tell whether n is even.",
    "Write the method `__len__(self)` of class `Stack` that does this: return the size.",
    "Write a Python function `read_lines(path)` that does this: return the lines of a file.",
]


@pytest.fixture(autouse=True)
def restore_threads():
    """The runs below use --threads 1 (small tensors on shared cores); put torch back after."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def heldout_prompts(path: Path, prompts: list[str]) -> Path:
    """A conversations file of ``prompts``, each from its own held-out source file."""
    rows = (
        {
            "messages": [{"role": "user", "content": p}, {"role": "assistant", "content": "x"}],
            "source": f"handwritten/{i}.py",
            "split": "heldout",
        }
        for i, p in enumerate(prompts)
    )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def untrained_draft(target: Path, out: Path) -> Path:
    config = json.loads((target / "config.json").read_text())
    draft_config = speculators_config(
        target_config=config,
        verifier_path=str(target),
        aux_layer_ids=[2, 3, 5],
        draft_vocab_size=config["vocab_size"],
    )
    spec = DraftSpec.from_config(draft_config)
    embed = torch.zeros(spec.target_vocab_size, spec.hidden_size)  # replaced by the target's
    draft = random_draft(spec, embed, seed=0)
    d2t = draft.d2t.numpy()
    t2d = torch.ones(spec.target_vocab_size, dtype=torch.bool).numpy()
    lineage = {
        "target_fingerprint": fingerprint_model_dir(target),
        "tokenizer_fingerprint": fingerprint_tokenizer_dir(target),
        "hidden_states_fingerprint": fingerprint_json("none: untrained"),
        "vocab_map_fingerprint": fingerprint_vocab_map(d2t, t2d),
    }
    header = make_header(
        "draft_checkpoint",
        lineage,
        aux_layer_ids=[2, 3, 5],
        training={"steps": 0},
        architecture="llama",
    )
    return save_draft(draft, out, draft_config, header.to_json())


def test_untrained_draft_scores_about_one(tmp_path: Path, tiny_target: Path) -> None:
    draft = untrained_draft(tiny_target, tmp_path / "draft")
    prompts = heldout_prompts(tmp_path / "prompts.jsonl", PROMPTS)
    out = tmp_path / "report"
    argv = ["reference", "--draft", str(draft), "--target", str(tiny_target)]
    argv += ["--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "32"]
    argv += ["--threads", "1"]
    assert main(argv) == 0
    assert validate(out) == []
    f = read_report(out).fields
    assert f["num_prompts"] == len(PROMPTS)
    assert 1.0 <= f["acceptance_length"] < 1.1
    assert f["engine"]["name"] == "transformers"
    # Greedy speculative decoding reproduces the target's own greedy output.
    assert f["outputs_identical_to_baseline"]["identical"] == len(PROMPTS)


# ---- the trained draft -----------------------------------------------------------------------


@pytest.mark.process
def test_asset_cache_key_is_the_content_of_what_builds_the_assets(tiny_target: Path) -> None:
    """No hand-bumped version: the key hashes the target, the builder, the eval and schemas
    modules it imports (followed through their sources), the schema files, and the settings;
    and it is the same in any process (the tests ask a subprocess for it)."""
    key = builder.assets_key(tiny_target, dict(builder.DEFAULTS))
    assert key["target_fingerprint"] == fingerprint_model_dir(tiny_target)
    assert key["tokenizer_fingerprint"] == fingerprint_tokenizer_dir(tiny_target)
    assert {
        "tests/support/tiny_draft.py",
        "tests/support/tiny_corpus.py",
        "eagle3_eval/__init__.py",
        "eagle3_eval/draft.py",
        "eagle3_eval/target.py",
        "eagle3_schemas/layouts/hidden_states.py",
        "eagle3_schemas/contract/checks/draft_checkpoint.py",  # through validate -> checks
        "eagle3_schemas/schema_files/draft_checkpoint/v1.json",
    } <= key["sources"].keys()
    # not used to build: no rebuild for them
    assert {"eagle3_eval/report.py", "eagle3_schemas/io/jsonl.py"}.isdisjoint(key["sources"])
    here = builder.default_dir(tiny_target, dict(builder.DEFAULTS))
    other = builder.default_dir(tiny_target, {**builder.DEFAULTS, "steps": 1})
    assert here != other
    assert Path(builder.run_fresh("--print-dir", capture=True).strip()) == here


def heldout_args(assets: Path, tiny_target: Path) -> list[str]:
    return [
        "--target",
        str(tiny_target),
        "--prompts",
        str(assets / "corpus.jsonl"),
        "--heldout-sources",
        str(tiny_target / "build_info.json"),
    ]


@pytest.mark.slow
def test_untrained_draft_scores_about_one_in_the_reference_loop(
    tmp_path: Path, tiny_assets: Path, tiny_target: Path
) -> None:
    """On the held-out prompts where the trained draft scores above 1.6 in the same loop (its
    run is shared with the vLLM comparison: test_vllm.py's reference_greedy)."""
    out = tmp_path / "random-draft"
    argv = ["reference", "--draft", str(tiny_assets / "random-draft")]
    argv += [*heldout_args(tiny_assets, tiny_target), "--out", str(out)]
    argv += ["--limit", "12", "--max-new-tokens", "64", "--no-baseline", "--threads", "1"]
    assert main(argv) == 0
    assert validate(out) == []
    assert read_report(out).fields["acceptance_length"] < 1.1


@pytest.mark.slow
def test_sampled_reference_run(tmp_path: Path, tiny_assets: Path, tiny_target: Path) -> None:
    out = tmp_path / "sampled"
    argv = [
        "reference",
        "--draft",
        str(tiny_assets / "draft"),
        *heldout_args(tiny_assets, tiny_target),
    ]
    argv += ["--out", str(out), "--limit", "6", "--max-new-tokens", "48", "--temperature", "0.8"]
    argv += ["--threads", "1"]
    assert main(argv) == 0
    f = read_report(out).fields
    assert f["temperature"] == 0.8 and f["sampling"]["draft_proposal"] == "greedy"
    assert f["acceptance_length"] > 1.3
    assert f["baseline_tokens_per_second"] > 0


@pytest.mark.slow
def test_offline_on_heldout_hidden_states(tmp_path: Path, tiny_assets: Path) -> None:
    lengths = {}
    for name in ("draft", "random-draft"):
        out = tmp_path / name
        argv = ["offline", "--draft", str(tiny_assets / name)]
        argv += ["--hidden-states", str(tiny_assets / "heldout_hidden_states"), "--out", str(out)]
        argv += ["--threads", "1"]
        assert main(argv) == 0
        f = read_report(out).fields
        assert f["engine"]["name"] == "offline"
        lengths[name] = f["acceptance_length"]
    assert lengths["random-draft"] < 1.1
    assert lengths["draft"] > 1.6, lengths


def test_reference_runs_put_their_table_into_the_drafts_card(tmp_path: Path, tiny_target: Path):
    """The card of the measured draft gets the report's numbers; a rerun of the same setting
    replaces its table, another setting adds one; huggingface_hub still reads the card."""
    from huggingface_hub import ModelCard

    from eagle3_schemas.layouts.model_card import TABLES_ANCHOR, front_matter

    from support.card import read_acceptance

    draft = untrained_draft(tiny_target, tmp_path / "draft")
    card = draft / "README.md"
    card.write_text(
        front_matter({"library_name": "vllm", "tags": ["eagle3"]})
        + f"\n# a draft\n\n## Acceptance\n\n{TABLES_ANCHOR}\n\n## Lineage\n"
    )
    prompts = heldout_prompts(tmp_path / "prompts.jsonl", PROMPTS[:2])
    common = ["reference", "--draft", str(draft), "--target", str(tiny_target)]
    common += ["--prompts", str(prompts), "--max-new-tokens", "8", "--threads", "1"]
    common += ["--no-baseline", "--no-figure"]

    reports = []
    for name, k in (("a", "3"), ("b", "3"), ("c", "2")):
        assert main([*common, "--k", k, "--out", str(tmp_path / name)]) == 0
        reports.append(read_report(tmp_path / name).fields)
        tables = read_acceptance(card.read_text())
        assert len(tables) == (1 if name != "c" else 2), [t["k"] for t in tables]
    by_k = {t["k"]: t for t in read_acceptance(ModelCard.load(card).text)}
    for report in reports[1:]:  # b replaced a; c has its own
        table = by_k[report["num_speculative_tokens"]]
        assert table["acceptance_length"] == pytest.approx(report["acceptance_length"], abs=5e-5)
        assert table["per_position_acceptance"] == pytest.approx(
            report["per_position_acceptance"], abs=5e-5
        )
        assert table["num_drafts"] == report["num_drafts"]
        assert table["num_prompts"] == report["num_prompts"] == 2
        assert table["engine"] == "transformers" and table["temperature"] == 0.0
    text = card.read_text()
    assert text.index("#### transformers") < text.index(TABLES_ANCHOR) < text.index("## Lineage")
