"""Every stage of a GPU recipe, with its flags.sh arrays and train.yaml, on a stand-in on CPU:
chat data → ingest → tokenize + vocab → `eagle3-extract preflight` and `run` (transformers
backend: the vLLM one needs a GPU) → `eagle3-train --preflight`. Shared by the committed
recipes' tests (tests/test_recipes.py) and the generated ones' (tests/test_generated_recipes.py).

Nothing of the recipe is restated: the stage flags are the arrays of its flags.sh, sourced by bash
with the size and device-count knobs set small; the one other change is ``--backend hf``. The
train config is its train.yaml with the paths and the stand-in's aux layer ids overridden
(``--set``, as the pipeline overrides paths), plus any ``draft_sets`` a caller names.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from eagle3_data.cli import main as data_main
from eagle3_extract.cli import main as extract_main
from eagle3_schemas.layouts.target_config import text_config

from support import recipes
from support.stage_cli import Outcome, run_cli, run_train_cli

# Knobs of flags.sh that size the run for this machine; every flag stays the recipe's.
CPU_KNOBS = {"NGPU": "1", "CPU_WORKERS": "1"}
FLAG_ARRAYS = ("TOKENIZE_ARGS", "VOCAB_ARGS", "EXTRACT_ARGS", "ACCELERATE_ARGS", "EVAL_ARGS")
EXIT_OK = 0


# A few conversations of the shapes real chat data has: single and multi-turn, a system prompt,
# code with blank lines, and a Qwen3-style answer with its thinking block.
CONVERSATIONS = [
    [
        {"role": "user", "content": "What does a draft model do in speculative decoding?"},
        {"role": "assistant", "content": "It proposes tokens that the target then verifies."},
    ],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why are aux hidden states taken from three layers?"},
        {"role": "assistant", "content": "Low, middle and high layers carry different features."},
        {"role": "user", "content": "And the last one?"},
        {"role": "assistant", "content": "The last layer's output feeds the target's head."},
    ],
    [
        {"role": "user", "content": "Write a Python function that squares a number."},
        {"role": "assistant", "content": "```python\ndef square(x):\n\n    return x * x\n```"},
    ],
    [
        {"role": "user", "content": "Is 17 prime?"},
        {
            "role": "assistant",
            "content": "<think>\n17 has no divisor between 2 and 4.\n</think>\n\nYes, 17 is prime.",
        },
    ],
    [
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green and blue."},
        {"role": "user", "content": "Two more?"},
        {"role": "assistant", "content": "Yellow and purple."},
    ],
]


def on_cpu(extract_args: list[str]) -> list[str]:
    """The recipe's extract flags with the transformers backend for vLLM's. vLLM's pass-through
    flags stay: the transformers backend accepts and ignores them."""
    i = extract_args.index("--backend")
    assert extract_args[i + 1] == "vllm", extract_args
    return [*extract_args[: i + 1], "hf", *extract_args[i + 2 :]]


def csv(ids: list[int]) -> str:
    return ",".join(str(i) for i in ids)


@dataclass
class StagesRun:
    """Every stage of one recipe on its stand-in, with each CLI's outcome."""

    recipe: str
    standin: Path
    aux_layer_ids: list[int]
    tokenized: Path
    vocab_map: Path
    hidden_states: Path
    outcomes: dict[str, Outcome]


def run_stages(
    recipe: str,
    work: Path,
    folder: Path,
    standin: Path,
    knobs: dict[str, str] = CPU_KNOBS,
    draft_sets: Sequence[str] = (),
) -> StagesRun:
    """Every stage of the recipe at ``folder`` on ``standin``, flags.sh sourced with ``knobs``;
    ``draft_sets`` are further ``--set`` overrides of the train config."""
    flags = recipes.stage_flags(folder, knobs, FLAG_ARRAYS)
    config = json.loads((standin / "config.json").read_text())
    layers = text_config(config)["num_hidden_layers"]
    aux = recipes.eagle3_aux_layer_ids(layers)  # the recipe's rule at the stand-in's depth
    tokenized = work / "train.tokenized.parquet"
    vocab_map, hidden_states = work / "vocab_map.safetensors", work / "hidden_states"
    extract = ["--model", str(standin), "--tokenized", str(tokenized), "--aux-layer-ids", csv(aux)]
    extract += [*on_cpu(flags["EXTRACT_ARGS"]), "--out", str(hidden_states)]
    outcomes = ingest_and_tokenize(CONVERSATIONS, standin, flags["TOKENIZE_ARGS"], work, tokenized)
    outcomes["vocab"] = run_cli(
        data_main, ["vocab", str(tokenized), *flags["VOCAB_ARGS"], "--out", str(vocab_map)]
    )
    outcomes["extract preflight"] = run_cli(extract_main, ["preflight", *extract])
    outcomes["extract run"] = run_cli(extract_main, ["run", *extract])
    outcomes["train preflight"] = run_train_cli(
        [
            "--config",
            str(folder / "train.yaml"),
            "--preflight",
            "--output-dir",
            str(work / "train"),
            # What the pipeline overrides (paths), plus the stand-in's layer ids.
            *("--set", f"target.path={standin}"),
            *("--set", f"data.hidden_states={hidden_states}"),
            *("--set", f"data.vocab_map={vocab_map}"),
            *("--set", f"draft.aux_layer_ids={aux}"),
            *(arg for s in draft_sets for arg in ("--set", s)),
        ]
    )
    return StagesRun(recipe, standin, aux, tokenized, vocab_map, hidden_states, outcomes)


def ingest_and_tokenize(
    conversations: Sequence[list[dict[str, str]]],
    standin: Path,
    tokenize_args: list[str],
    work: Path,
    tokenized: Path,
) -> dict[str, Outcome]:
    """Chat records → `eagle3-data ingest` → `tokenize` with the recipe's flags, into ``tokenized``."""
    raw, ingested = work / "chat.jsonl", work / "train.conversations.parquet"
    raw.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    outcomes = {"ingest": run_cli(data_main, ["ingest", str(raw), "--out", str(ingested)])}
    tokenize = ["tokenize", str(ingested), "--tokenizer", str(standin), *tokenize_args]
    outcomes["tokenize"] = run_cli(data_main, [*tokenize, "--out", str(tokenized)])
    return outcomes


def passed(run: StagesRun, stage: str) -> Outcome:
    outcome = run.outcomes[stage]
    assert outcome.code == EXIT_OK, (
        f"{run.recipe}: {stage} exited {outcome.code}:\n{outcome.stdout[-2000:]}\n{outcome.log[-3000:]}"
    )
    return outcome
