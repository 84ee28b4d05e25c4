"""Test support: a benchmark-format prompt file the tiny target can answer.

``write_mt_bench`` turns the tiny corpus's held-out conversations into MT-Bench's
``question.jsonl`` format: one category per held-out source file, each question two user turns
from that file (the second asked after the target's answer to the first, as MT-Bench does).
The tiny pipeline's test and eval's vLLM tests measure acceptance per category on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle3_eval.prompts import source_file
from eagle3_schemas.io.atomic import atomic_path

# Held-out source files of the tiny corpus with enough conversations for several questions.
MT_BENCH_SOURCES = ("operator.py", "statistics.py", "turtle.py")


def write_mt_bench(
    corpus: Path,
    out: Path,
    sources: tuple[str, ...] = MT_BENCH_SOURCES,
    per_category: int = 2,
) -> Path:
    """``out``: ``per_category`` two-turn questions per source file (category: the file's name
    without .py), from the corpus's held-out rows in file order; ids 1, 2, ... as MT-Bench's."""
    rows = [json.loads(line) for line in corpus.read_text(encoding="utf-8").splitlines() if line]
    questions = []
    for source in sources:
        users = [
            r["messages"][0]["content"]
            for r in rows
            if r.get("split") == "heldout" and source_file(r["source"]) == source
        ]
        if len(users) < 2 * per_category:
            raise ValueError(f"{corpus}: {len(users)} held-out rows from {source}, need more")
        for i in range(per_category):
            questions.append(
                {
                    "question_id": len(questions) + 1,
                    "category": Path(source).stem,
                    "turns": users[2 * i : 2 * i + 2],
                }
            )
    with atomic_path(out) as tmp:
        tmp.write_text("".join(json.dumps(q) + "\n" for q in questions), encoding="utf-8")
    return out
