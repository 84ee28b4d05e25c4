"""What the 8B recipes (recipes/llama-3.1-8b, recipes/qwen3-8b) know about their targets.

Each recipe folder holds ``target_config.json``: the target's public ``config.json`` as published
on the hub (architecture, sizes, RoPE, vocabulary, special ids, in that file's own layout). This
module is the one reader of those facts, used by:

- the recipe's ``pipeline.sh``, before any GPU work:
      python recipes/recipe_targets.py check RECIPE_DIR MODEL_DIR   # is MODEL the recipe's target?
      python recipes/recipe_targets.py aux-ids RECIPE_DIR           # train.yaml's ids, for extract
      python recipes/recipe_targets.py accumulation RECIPE_DIR PLANNED_GPUS NGPU
                                        # micro-batches per step that keep train.yaml's lrs valid
- ``tests/test_recipes.py`` and ``tests/test_kimi_recipe.py``, which run every stage's preflight
  with the recipe's own flags on a scaled-down stand-in (tests/support/recipe_standins.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
FACTS_FILE = "target_config.json"
TRAIN_FILE = "train.yaml"

# What a real target must share with the recipe's facts for the recipe's numbers to hold.
CHECKED_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)
WRAPPER_KEYS = ("model_type", "architectures")


class RecipeError(ValueError):
    """A recipe's files, or a target directory, do not agree with each other."""


def target_facts(recipe_dir: Path) -> dict[str, Any]:
    return json.loads((Path(recipe_dir) / FACTS_FILE).read_text(encoding="utf-8"))


def train_config(recipe_dir: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((Path(recipe_dir) / TRAIN_FILE).read_text(encoding="utf-8"))


def recipe_aux_layer_ids(recipe_dir: Path) -> list[int]:
    """The aux layer ids of the recipe's train.yaml: the pipeline extracts exactly these."""
    return list(train_config(recipe_dir)["draft"]["aux_layer_ids"])


def accumulation_steps(recipe_dir: Path, planned_gpus: int, ngpu: int) -> int:
    """Gradient accumulation on ``ngpu`` GPUs that keeps train.yaml's tokens per optimizer step.

    train.yaml's lrs are set for ``planned_gpus`` x ``max_tokens_per_batch`` x
    ``gradient_accumulation_steps`` tokens per step (docs/benchmarks/lr-width.md: the lr moves
    with the tokens per step). Another GPU count keeps that step by accumulating more (or fewer)
    micro-batches; a count that cannot keep it whole is refused, naming the change.
    """
    config = train_config(recipe_dir)
    accumulation = int(config["train"].get("gradient_accumulation_steps", 1))
    batch = int(config["data"]["max_tokens_per_batch"])
    passes = planned_gpus * accumulation  # micro-batches per step, over all GPUs
    if ngpu < 1 or passes % ngpu:
        tokens = passes * batch
        divisors = [n for n in range(1, passes + 1) if passes % n == 0]
        raise RecipeError(
            f"NGPU={ngpu}: {Path(recipe_dir) / TRAIN_FILE}'s lrs are set for {tokens:,} tokens per "
            f"step ({planned_gpus} GPUs x {batch:,} x {accumulation}), which {ngpu} GPU(s) cannot "
            f"make from whole {batch:,}-token micro-batches. Use NGPU in {divisors}, or plan the "
            f"recipe for {ngpu} GPUs: eagle3-recipe new --target MODEL --gpus {ngpu} --gpu KIND"
        )
    return passes // ngpu


def check_target(recipe_dir: Path, model_dir: Path) -> list[str]:
    """Where ``model_dir/config.json`` differs from the recipe's facts (empty: it is the target)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return [f"{model_dir}: no config.json; expected the recipe's target model directory"]
    from eagle3_schemas.layouts.target_config import text_config

    actual = json.loads(config_path.read_text(encoding="utf-8"))
    expected = target_facts(recipe_dir)
    facts = Path(recipe_dir) / FACTS_FILE

    def value(config: dict[str, Any], key: str) -> Any:
        # A wrapper's (Kimi-K2.5's) sizes sit under text_config; its kind stays at the top.
        return config.get(key) if key in WRAPPER_KEYS else text_config(config).get(key)

    return [
        f"{key}: {config_path} has {value(actual, key)!r} but {facts} expects {value(expected, key)!r}"
        for key in CHECKED_KEYS
        if value(actual, key) != value(expected, key)
    ]


def parameter_count(facts: dict[str, Any]) -> int:
    """Parameters of a dense Llama/Qwen3 decoder from its config (for the resource sheets)."""
    h, v, n = facts["hidden_size"], facts["vocab_size"], facts["num_hidden_layers"]
    heads, kv = facts["num_attention_heads"], facts["num_key_value_heads"]
    head_dim = facts.get("head_dim", h // heads)
    attention = h * heads * head_dim * 2 + h * kv * head_dim * 2  # q, o; k, v
    qk_norm = 2 * head_dim if facts["model_type"] == "qwen3" else 0
    layer = attention + 3 * h * facts["intermediate_size"] + 2 * h + qk_norm
    embeddings = v * h * (1 if facts.get("tie_word_embeddings") else 2)
    return n * layer + embeddings + h


def main(argv: list[str]) -> int:
    usage = (
        "usage: recipe_targets.py check RECIPE_DIR MODEL_DIR | aux-ids RECIPE_DIR"
        " | accumulation RECIPE_DIR PLANNED_GPUS NGPU"
    )
    if len(argv) == 3 and argv[0] == "check":
        problems = check_target(Path(argv[1]), Path(argv[2]))
        for problem in problems:
            print(f"recipe_targets check: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if len(argv) == 2 and argv[0] == "aux-ids":
        print(",".join(str(i) for i in recipe_aux_layer_ids(Path(argv[1]))))
        return 0
    if len(argv) == 4 and argv[0] == "accumulation":
        try:
            print(accumulation_steps(Path(argv[1]), int(argv[2]), int(argv[3])))
        except (RecipeError, ValueError) as exc:
            print(f"recipe_targets accumulation: {exc}", file=sys.stderr)
            return 2
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
