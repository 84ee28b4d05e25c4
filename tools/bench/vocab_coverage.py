"""How much of the target's next-token distribution a draft vocabulary covers, per size and rule.

A draft proposes only tokens of its vocabulary, so what the vocabulary leaves out caps
acceptance: under greedy serving, the held-out positions whose target argmax is outside it;
at T = 1, the target's probability mass outside it (a draft sampling its proposals is accepted
with 1 - TV(p, q), which that mass bounds). Two rules choose the V_draft target ids:

- counts: the answer tokens of the training set, most frequent first (eagle3-data vocab's
  ranking, the rule every recipe uses);
- mass: the target's own probability of each token, summed over the training set's answer
  positions (one pass over the extracted last states through the target's norm and head).

Both are chosen on the training set of a pipeline run and scored on its held-out states, at
full, 1/2, 1/4, ... of the target's vocabulary. Prints a Markdown table, or with --json the
rows of a `grid` table for docs/benchmarks/vocabulary.json.

    uv run --frozen python tools/bench/vocab_coverage.py --run runs/tiny [--json]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from eagle3_data.vocab import build_vocab_map
from eagle3_eval.offline import TargetHead, read_samples
from eagle3_schemas.contract.header import read_header

COLUMNS = ["draft vocabulary", "rule", "T = 1 mass", "greedy argmax", "answer token"]


def next_token_probs(
    dataset: Path, head: TargetHead
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per sample: (the target's next-token distribution at every position followed by an
    answer token [n, V], that answer token [n])."""
    for sample in read_samples(dataset, None):
        rows = torch.nonzero(sample.loss_mask[1:]).squeeze(-1)
        yield torch.softmax(head.logits(sample.last[rows]), dim=-1), sample.input_ids[rows + 1]


def coverage_rows(run: Path) -> list[list[object]]:
    train = run / "hidden_states"
    eps = read_header(train / "dataset.json").fields["target"]["rms_norm_eps"]
    head = TargetHead(load_file(str(train / "target_head.safetensors")), eps)
    vocab = head.lm_head.shape[0]
    counts, mass = np.zeros(vocab, dtype=np.int64), torch.zeros(vocab, dtype=torch.float64)
    for probs, answers in next_token_probs(train, head):  # summed as read: [N, V] never whole
        counts += np.bincount(answers.numpy(), minlength=vocab)
        mass += probs.double().sum(0)
    held = list(next_token_probs(run / "heldout_hidden_states", head))
    held_probs, held_answers = torch.cat([p for p, _ in held]), torch.cat([a for _, a in held])
    argmax = held_probs.argmax(-1)
    rows = []
    for size in (vocab >> i for i in range(6)):  # full, 1/2, ..., 1/32
        for rule, score in (("counts", counts), ("mass", mass.numpy())):
            chosen = torch.from_numpy(build_vocab_map(score, size).t2d)
            rows.append(
                [
                    f"{size:,} of {vocab:,}",
                    rule,
                    f"{float(held_probs[:, chosen].sum(-1).mean()):.4f}",
                    f"{float(chosen[argmax].double().mean()):.4f}",
                    f"{float(chosen[held_answers].double().mean()):.4f}",
                ]
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--run", type=Path, required=True, help="output folder of pipeline.sh")
    p.add_argument("--json", action="store_true", help="the rows as JSON")
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = coverage_rows(args.run)
    if args.json:
        print(json.dumps({"columns": COLUMNS, "rows": rows}, indent=1))
        return 0
    print("| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
