"""The model card an export carries (README.md): huggingface_hub's card reader parses it, it
names the target, the draft's shape and data, the serve command, and eval's tables survive a
refresh (``--card-only``)."""

from __future__ import annotations

import json
import shlex

import pytest
from huggingface_hub import ModelCard

from eagle3_schemas.contract.validate import validate
from eagle3_schemas.layouts.model_card import put_acceptance
from eagle3_train.export.card import parameter_counts

from support.card import read_acceptance
from support.train import make_inputs, write_config

CARD = {
    "repo_id": "acme/tiny-eagle3",
    "base_model": "acme/tiny-target",
    "license": "apache-2.0",
    "datasets": ["acme/chats"],
    "serve_args": ["--tensor-parallel-size", "8"],
}


@pytest.fixture
def run(tmp_path, in_process):
    inputs = make_inputs(tmp_path / "inputs", num_samples=24)
    out = tmp_path / "run"
    config = write_config(
        inputs,
        out,
        # trains more TTT steps (4) than it serves (export.speculative_tokens: 2)
        train={"max_steps": 2, "save_every": 0, "warmup_steps": 1, "ttt_steps": 4},
        export={"dtype": "float32", "speculative_tokens": 2, "card": CARD},
    )
    assert in_process(["--config", str(config)]) == 0
    return out, config


def test_the_export_carries_a_card_the_hub_reader_parses(run):
    out, _ = run
    draft = out / "draft"
    assert validate(draft) == []  # the card is beside the artifact, not in its way
    card = ModelCard.load(draft / "README.md")
    data = card.data.to_dict()
    assert data["base_model"] == "acme/tiny-target"
    assert data["license"] == "apache-2.0" and data["datasets"] == ["acme/chats"]
    assert data["library_name"] == "vllm" and data["pipeline_tag"] == "text-generation"
    assert {"eagle3", "speculative-decoding", "speculators"} <= set(data["tags"])

    header = json.loads((draft / "eagle3.json").read_text())
    body = card.text
    serve = [line for line in body.splitlines() if line.startswith("vllm serve")]
    assert len(serve) == 1
    words = shlex.split(serve[0])
    assert words[:3] == [
        "vllm",
        "serve",
        str(
            json.loads((draft / "config.json").read_text())["speculators_config"]["verifier"][
                "name_or_path"
            ]
        ),
    ]
    assert words[3:5] == ["--tensor-parallel-size", "8"]
    spec = json.loads(words[words.index("--speculative-config") + 1])
    assert spec == {"method": "eagle3", "model": "acme/tiny-eagle3", "num_speculative_tokens": 2}
    # facts from the files: sizes, data, training totals, lineage
    counts = parameter_counts(draft / "model.safetensors")
    assert f"{counts['draft']:,} parameters" in body
    assert "24 samples" in body and "stored as float32" in body
    assert header["training"]["steps"] == 2  # train.max_steps, not the card's own source
    assert "2 optimizer steps" in body
    assert "draft vocabulary 24 of the target's 64 tokens" in body
    assert "layers [1, 2, 3]" in body
    for fingerprint in header["lineage"].values():
        if isinstance(fingerprint, str):
            assert fingerprint in body


def test_the_served_k_is_export_speculative_tokens_not_ttt_steps(run):
    out, _ = run
    draft = out / "draft"
    speculators = json.loads((draft / "config.json").read_text())["speculators_config"]
    [greedy] = speculators["proposal_methods"]
    assert greedy["speculative_tokens"] == 2  # export.speculative_tokens; train.ttt_steps is 4
    body = ModelCard.load(draft / "README.md").text
    assert "proposing 2 tokens per step" in body
    assert "test-time-training unroll of 4 steps" in body


def test_the_card_says_what_accept_len_proxy_estimates(run):
    out, _ = run
    body = ModelCard.load(out / "draft" / "README.md").text
    [at_export] = [line for line in body.splitlines() if line.startswith("- at export:")]
    assert "val/accept_len_proxy" in at_export
    assert (
        "`val/accept_len_proxy` is the training-time estimate of vLLM's acceptance length" in body
    )


def _files_but(directory, card) -> dict[str, bytes]:
    """Every file under ``directory`` but ``card``: relative path -> bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p != card
    }


def test_card_only_refreshes_the_card_and_keeps_evals_tables(run, in_process):
    out, config = run
    draft = out / "draft"
    report = {
        "mode": "vllm",
        "engine": {"name": "vllm", "versions": {"vllm": "0.32.0"}},
        "num_speculative_tokens": 3,
        "temperature": 0.0,
        "prompts": {"fingerprint": "sha256:" + "1" * 64},
        "sampling": {"max_new_tokens": 64},
        "num_prompts": 12,
        "num_drafts": 200,
        "acceptance_length": 2.5,
        "per_position_acceptance": [0.8, 0.45, 0.25],
        "speedup": 1.7,
    }
    card = draft / "README.md"
    card.write_text(put_acceptance(card.read_text(), report))
    others = _files_but(draft, card)
    assert {"config.json", "model.safetensors", "eagle3.json"} <= set(others)
    assert (
        in_process(
            ["--config", str(config), "--card-only", str(draft), "--set", "export.card.license=mit"]
        )
        == 0
    )
    # the draft's other files are left as they were, byte for byte
    assert _files_but(draft, card) == others
    refreshed = ModelCard.load(card)
    assert refreshed.data.license == "mit"
    [table] = read_acceptance(refreshed.text)
    assert table["acceptance_length"] == 2.5 and table["num_drafts"] == 200


def test_card_only_refuses_a_directory_that_is_not_a_draft(tmp_path, in_process, capsys):
    inputs = make_inputs(tmp_path / "inputs", num_samples=8)
    config = write_config(inputs, tmp_path / "run")
    assert in_process(["--config", str(config), "--card-only", str(inputs.hidden_states)]) == 2
    assert "--card-only" in capsys.readouterr().err
