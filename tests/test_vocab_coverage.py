"""tools/bench/vocab_coverage.py: each rule's draft vocabulary, chosen on a run's training states,
scored on its held-out states, from the full vocabulary down to a 32nd of it."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import torch

from support.scripts import load_script
from support.synthetic_states import write_dataset

ROOT = Path(__file__).resolve().parents[1]
TOOL = load_script(ROOT / "tools" / "bench" / "vocab_coverage.py")


def test_coverage_is_whole_at_the_full_vocabulary_and_shrinks_with_it(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_dataset(run / "hidden_states", num_samples=48, v_target=64)
    write_dataset(run / "heldout_hidden_states", num_samples=16, v_target=64, label="heldout")
    rows = TOOL.coverage_rows(run)
    sizes = [f"{64 >> i} of 64" for i in range(6)]
    assert [r[0] for r in rows] == [s for s in sizes for _ in range(2)]
    assert [r[1] for r in rows] == ["counts", "mass"] * 6
    assert all(float(c) == 1.0 for r in rows[:2] for c in r[2:])
    for rule in ("counts", "mass"):
        columns = [[float(c) for c in r[2:]] for r in rows if r[1] == rule]
        for wider, narrower in pairwise(columns):
            assert all(a >= b for a, b in zip(wider, narrower, strict=True)), (rule, columns)
        assert columns[-1][0] < 1.0  # two ids of 64 leave the target's mass out


def _one_shard(dataset: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(the target's next-token distribution at each position followed by an answer token of
    its sample, that token), straight from a one-shard dataset's tensors."""
    from safetensors.torch import load_file

    shard = load_file(str(next((dataset / "shards").glob("*.safetensors"))))
    head = load_file(str(dataset / "target_head.safetensors"))
    edges = shard["cu_seqlens"].tolist()
    rows = [
        i
        for start, end in pairwise(edges)
        for i in range(start, end - 1)
        if shard["loss_mask"][i + 1]
    ]
    x = shard["last_hidden_state"][rows].float()
    x = head["norm.weight"] * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    probs = torch.softmax(x @ head["lm_head.weight"].float().T, dim=-1)
    return probs, shard["input_ids"][torch.tensor(rows) + 1].long()


def test_each_figure_is_the_held_out_share_the_chosen_ids_hold(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_dataset(run / "hidden_states", num_samples=24, v_target=64, samples_per_shard=64)
    write_dataset(run / "heldout_hidden_states", num_samples=8, v_target=64, samples_per_shard=64)
    train_probs, train_answers = _one_shard(run / "hidden_states")
    held_probs, held_answers = _one_shard(run / "heldout_hidden_states")
    counts = torch.bincount(train_answers, minlength=64).double()
    mass = train_probs.double().sum(0)
    rows = {(r[0], r[1]): [float(c) for c in r[2:]] for r in TOOL.coverage_rows(run)}
    for rule, score in (("counts", counts), ("mass", mass)):
        # the 16 highest-scoring ids, ties to the lower id
        order = sorted(range(64), key=lambda t: (-float(score[t]), t))[:16]
        chosen = torch.zeros(64, dtype=torch.bool)
        chosen[order] = True
        expected = [
            float(held_probs[:, chosen].sum(-1).mean()),
            float(chosen[held_probs.argmax(-1)].double().mean()),
            float(chosen[held_answers].double().mean()),
        ]
        assert rows[("16 of 64", rule)] == [round(e, 4) for e in expected], rule
