"""Offline simulation: anchor selection and scoring on hand-built logits; fixture end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from eagle3_eval.config import OfflineConfig
from eagle3_eval.offline import accepted_counts, anchors, run_offline, score
from eagle3_eval.preflight import PreflightError
from eagle3_eval.report import read_report, write_report
from eagle3_schemas.contract.lineage import fingerprint_artifact
from eagle3_schemas.contract.validate import validate


def one_hot_logits(tokens: list[list[int]], vocab: int = 6) -> torch.Tensor:
    """[n, k, vocab] logits whose argmax is ``tokens`` (a clear margin, no ties)."""
    logits = torch.zeros(len(tokens), len(tokens[0]), vocab)
    for i, row in enumerate(tokens):
        for j, token in enumerate(row):
            logits[i, j, token] = 5.0
    return logits


def test_anchors_need_k_assistant_inputs() -> None:
    mask = torch.tensor([0, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    # Row t needs x_{t+1}..x_{t+k} assistant tokens: for k=2, t+1 in {2, 3, 4}.
    assert anchors(mask, 2).tolist() == [1, 2, 3]
    assert anchors(mask, 4).tolist() == [1]
    assert anchors(mask, 5).tolist() == []
    assert anchors(torch.tensor([1], dtype=torch.bool), 1).tolist() == []


def test_accepted_prefix_stops_at_the_first_miss() -> None:
    matches = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    assert accepted_counts(matches).tolist() == [3, 1, 0, 2]


def test_greedy_score_on_hand_built_logits() -> None:
    target = one_hot_logits([[1, 2, 3], [1, 2, 3], [4, 4, 4]])
    drafted = torch.tensor([[1, 2, 3], [1, 5, 3], [0, 4, 4]])
    accepted, expected = score(drafted, target, 0.0, torch.Generator())
    assert accepted.tolist() == [3, 1, 0]
    assert expected == 4.0
    # +1 convention over these three drafts: 1 + 4/3.


def test_sampled_score_matches_its_expectation() -> None:
    # Every position accepts with probability p(d) = 0.5 at temperature 1.
    logits = torch.log(torch.tensor([0.5, 0.25, 0.25])).expand(20000, 2, 3).clone()
    drafted = torch.zeros(20000, 2, dtype=torch.long)
    accepted, expected = score(drafted, logits, 1.0, torch.Generator().manual_seed(0))
    assert expected == pytest.approx(20000 * (0.5 + 0.25))
    assert float(accepted.float().mean()) == pytest.approx(0.75, abs=0.02)
    # Lower temperature sharpens p toward the draft's token: more accepted.
    _, sharper = score(drafted, logits, 0.25, torch.Generator())
    p0 = 0.5**4 / (0.5**4 + 2 * 0.25**4)
    assert sharper == pytest.approx(20000 * (p0 + p0 * p0), rel=1e-4)


def test_fixture_dataset_end_to_end(
    tmp_path: Path, fixture_draft: Path, fixture_hidden_states: Path
) -> None:
    config = OfflineConfig(
        draft=fixture_draft,
        hidden_states=fixture_hidden_states,
        out=tmp_path / "report",
        k=2,
        temperatures=(0.0, 0.8),
    )
    results = run_offline(config)
    assert [r.temperature for r in results] == [0.0, 0.8]
    for result, name in zip(results, ("t0", "t08"), strict=True):
        s = result.summary
        # Anchors of the fixture's samples (lengths 5, 9, 7; answer = second half), k=2.
        assert s.num_drafts == 2 + 4 + 3
        assert s.num_draft_tokens == 2 * s.num_drafts
        assert math.isclose(s.acceptance_length, 1 + sum(s.per_position_acceptance))
        out = write_report(result, tmp_path / name)
        assert validate(out) == []
        report = read_report(out)
        assert report.fields["lineage"]["prompts_fingerprint"].startswith("sha256:")
        assert report.fields["sampling"]["temperature"] == result.temperature


def test_refuses_mismatched_layer_ids(
    tmp_path: Path, fixture_draft: Path, fixture_hidden_states: Path
) -> None:
    config = json.loads((fixture_draft / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]
    (fixture_draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(PreflightError, match="aux layer ids differ"):
        run_offline(
            OfflineConfig(
                draft=fixture_draft,
                hidden_states=fixture_hidden_states,
                out=tmp_path / "r",
                ignore_lineage=True,
            )
        )


def test_held_out_wording_says_what_the_lineage_proves(
    tmp_path: Path, fixture_draft: Path, fixture_hidden_states: Path
) -> None:
    def held_out_by(draft: Path, out: str) -> str:
        config = OfflineConfig(draft=draft, hidden_states=fixture_hidden_states, out=tmp_path / out)
        return run_offline(config)[0].extra["prompts"]["held_out_by"]

    with_lineage = held_out_by(fixture_draft, "a")
    trained_on = json.loads((fixture_draft / "eagle3.json").read_text())["lineage"][
        "hidden_states_fingerprint"
    ]
    assert with_lineage.startswith(f"lineage: the draft was trained on hidden states {trained_on}")
    assert fingerprint_artifact(fixture_hidden_states) in with_lineage

    (fixture_draft / "eagle3.json").unlink()  # a foreign checkpoint: nothing says what it saw
    foreign = held_out_by(fixture_draft, "b")
    assert foreign == (
        "UNVERIFIED: the draft records no lineage, so whether it was trained on these hidden "
        "states is unknown"
    )
    assert "other than the one the draft was trained on" not in foreign
