"""eagle3-recipe: each decision's rule, plans for public targets' stand-ins, the committed recipes
as the planner's output, and bad input refused before anything is written.

The stand-ins are the published config.json files of eleven targets across the families (with
their tokenizers' EOS and a template carrying the published template's markers), under
tests/fixtures/public_targets; no weights are read.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import pytest
import yaml

from eagle3_recipe import rules
from eagle3_recipe.cli import main as recipe_main
from eagle3_recipe.gpus import GPUS, gpu_kind
from eagle3_recipe.plan import Plan, Request, make_plan
from eagle3_recipe.target import PlanError, read_target
from eagle3_recipe.write import cpu_flags, gpu_flags, train_yaml
from eagle3_train.config.run_config import load_config

from support import public_targets

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


def plan_for(name: str, tmp_path: Path, gpu: str = "h200", **kw: object) -> Plan:
    return make_plan(Request(public_targets.model_dir(name, tmp_path), gpu, **kw))  # type: ignore[arg-type]


# ---- each decision --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "ids"), [(32, [2, 16, 29]), (36, [2, 18, 33]), (61, [2, 30, 58]), (6, [2, 3, 5])]
)
def test_aux_layer_ids_count_as_vllm_and_name_sglangs(layers: int, ids: list[int]) -> None:
    decision = rules.aux_layer_ids(layers)
    assert decision.value == ids
    assert str([i - 1 for i in ids]) in decision.reason  # SGLang's ids for the same tensors


def test_the_draft_layer_by_attention_kind(tmp_path: Path) -> None:
    kimi = read_target(public_targets.model_dir("Kimi-K2.5", tmp_path))
    gpu = rules.draft_layer(kimi, gpu_kind("h200")).value
    assert gpu == {
        "architecture": "llama",
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "head_dim": 128,
        "intermediate_size": 12288,
    }
    assert rules.draft_layer(kimi, gpu_kind("cpu")).value == {"architecture": "mla"}
    llama = read_target(public_targets.model_dir("Llama-3.2-1B-Instruct", tmp_path))
    assert rules.draft_layer(llama, gpu_kind("h100")).value == {"architecture": "llama"}


@pytest.mark.parametrize(
    ("vocab", "size"), [(163840, 32000), (128256, 32000), (32768, 16384), (2048, 1024)]
)
def test_the_draft_vocabulary_is_provisional(vocab: int, size: int, tmp_path: Path) -> None:
    folder = public_targets.model_dir("Llama-3.1-8B-Instruct", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": vocab}))
    decision = rules.draft_vocab(read_target(folder))
    assert decision.value == size and "Provisional" in decision.reason


def test_regeneration_follows_the_template_and_family(tmp_path: Path) -> None:
    qwen = rules.regeneration(read_target(public_targets.model_dir("Qwen3-8B", tmp_path)), {}).value
    assert (qwen.thinking_fraction, qwen.max_tokens) == (0.75, 6144)
    assert (qwen.reasoning_parser, qwen.tool_parser) == ("qwen3", "hermes")
    kimi = rules.regeneration(
        read_target(public_targets.model_dir("Kimi-K2.5", tmp_path)), {}
    ).value
    assert (kimi.max_tokens, kimi.reasoning_parser, kimi.tool_parser) == (
        16384,
        "kimi_k2",
        "kimi_k2",
    )
    llama_dir = public_targets.model_dir("Llama-3.1-8B-Instruct", tmp_path)
    llama = rules.regeneration(read_target(llama_dir), {"temperature": 0.6, "top_p": 0.9}).value
    assert (llama.thinking_fraction, llama.max_tokens, llama.reasoning_parser) == (None, 2048, None)
    assert (llama.temperature, llama.top_p, llama.tool_parser) == (0.6, 0.9, None)
    deepseek = read_target(public_targets.model_dir("DeepSeek-V3", tmp_path))
    assert rules.regeneration(deepseek, {}).value.thinking_fraction is None  # V3's has no <think>


def test_max_length_is_the_answer_cap_and_prompt_or_the_largest_that_fits() -> None:
    regen = rules.Regeneration(0.6, 0.95, 16384, 0.75, True, "kimi_k2", "kimi_k2")
    assert rules.max_length(regen, gpu_kind("h200"), 7168, 11.4e9, True).value == 32768
    small = rules.max_length(regen, gpu_kind("h200", 48), 7168, 11.4e9, True)
    # 0.9 x 48 GiB - 11.4 GB = 35.0 GB at 1.93 MB/token: 18,200 tokens -> 16,384
    assert small.value == 16384 and "largest power of two" in small.reason
    with pytest.raises(PlanError, match="no 2,048-token sample trains"):
        rules.max_length(regen, gpu_kind("h200", 12), 7168, 11.4e9, True)


def test_tokens_per_step_and_accumulation_from_gpus_and_nodes() -> None:
    h100 = gpu_kind("h100")
    assert rules.gradient_accumulation(8, 8192, h100).value == 1
    assert rules.gradient_accumulation(1, 8192, h100).value == 8  # the 1-GPU trap: 65,536 kept
    assert rules.gradient_accumulation(16, 8192, h100).value == 1  # two nodes: 131,072


@pytest.mark.parametrize(
    ("hidden", "tokens", "gpu", "adamw", "muon"),
    [
        (4096, 65536, "h100", 1.0e-4, 3.0e-4),  # the 8B recipes
        (7168, 262144, "h200", 1.1e-4, 3.4e-4),  # Kimi-K2.5: x 4096/7168 x 2
        (4096, 131072, "h100", 1.4e-4, 4.2e-4),  # two nodes: x sqrt(2)
        (256, 2048, "cpu", 1.0e-3, 5.0e-3),  # the tiny recipes
        (128, 2048, "cpu", 1.0e-3, 5.0e-3),  # tiny-agent: held at the anchor, reason stated
    ],
)
def test_lrs_from_width_and_tokens_per_step(
    hidden: int, tokens: int, gpu: str, adamw: float, muon: float
) -> None:
    decision = rules.learning_rates(hidden, tokens, gpu_kind(gpu))
    assert decision.value == {"adamw": adamw, "muon": muon}
    assert "docs/benchmarks/lr-width.md" in decision.reason
    if hidden < 256:
        assert "reproducible" in decision.reason and "1e-2" in decision.reason


def test_zero_stage_from_the_drafts_state() -> None:
    h100, h200 = gpu_kind("h100"), gpu_kind("h200")
    llama_draft = 424_726_528  # the 8B draft's trainable params
    assert rules.zero_stage(llama_draft, 656_408_576, 8, 8192, 4096, h100).value == "ddp"
    kimi = rules.zero_stage(1_058_830_336, 1_403_781_120, 8, 32768, 7168, h200)
    assert kimi.value == "zero2" and "16.9 GB" in kimi.reason
    # 12B trainable: ZeRO-2 keeps 48 GB of fp32 weights per rank, over an H100 with activations
    assert rules.zero_stage(12 * 10**9, 1_403_781_120, 8, 8192, 4096, h100).value == "zero3"
    with pytest.raises(PlanError, match="lower --max-length"):
        rules.zero_stage(1_058_830_336, 1_403_781_120, 8, 32768, 7168, gpu_kind("h100", 60))


def test_extraction_parallelism_from_weights_and_heads(tmp_path: Path) -> None:
    kimi = read_target(public_targets.model_dir("Kimi-K2.5", tmp_path))
    on = {
        g: rules.extraction_layout(kimi, gpu_kind(g), 8, 1, 32768).value for g in ("h200", "b300")
    }
    assert (on["h200"].tp, on["h200"].workers) == (8, 1)  # the recipe's
    assert (on["b300"].tp, on["b300"].workers) == (4, 2)  # 288 GiB holds a quarter
    with pytest.raises(PlanError, match=r"--nodes 2"):
        rules.extraction_layout(kimi, gpu_kind("h100"), 8, 1, 32768)
    two_nodes = rules.extraction_layout(kimi, gpu_kind("h100"), 8, 2, 32768).value
    assert (two_nodes.tp, two_nodes.pp) == (8, 2)
    with pytest.raises(PlanError, match=r"6 does not divide num_attention_heads 64"):
        rules.extraction_layout(kimi, gpu_kind("h200"), 6, 1, 32768)


def test_storage_dtype_and_streaming_under_the_disk_budget(tmp_path: Path) -> None:
    kimi = read_target(public_targets.model_dir("Kimi-K2.5", tmp_path))
    llama = read_target(public_targets.model_dir("Llama-3.1-8B-Instruct", tmp_path))
    assert rules.storage(kimi, 3, 10**8, 10**9, None).value.bytes_per_token == 28_693
    assert rules.storage(llama, 3, 10**8, 10**9, None).value.dtype == "bfloat16"
    assert rules.storage(llama, 3, 10**8, 10**9, None).value.bytes_per_token == 32_773
    # 100M tokens: 3.3 TB in bf16 over a 2 TB budget -> fp8 (1.6 TB), no stream
    tight = rules.storage(llama, 3, 10**8, 10**9, 2e12).value
    assert (tight.dtype, tight.stream) == ("fp8_e4m3", False)
    assert rules.storage(llama, 3, 10**8, 10**9, 1e12).value.stream
    with pytest.raises(PlanError, match="below one shard"):
        rules.storage(llama, 3, 10**8, 10**9, 5e8)


# ---- plans for public targets -----------------------------------------------------------------


@pytest.mark.parametrize("name", public_targets.PLANNED)
def test_a_plan_for_each_public_target_is_sane(name: str, tmp_path: Path) -> None:
    plan = plan_for(name, tmp_path, gpu="h200")
    t, v = plan.target, plan.value
    ids = v("aux_layer_ids")
    assert ids == sorted(set(ids)) and ids[0] >= 1 and ids[-1] < t.num_layers
    length = v("max_length")
    assert 4096 <= length <= 32768 and length & (length - 1) == 0
    assert plan.totals["tokens_per_step"] >= 65536
    lr = v("lr")
    assert 1e-5 < lr["adamw"] < lr["muon"] < 1e-3
    layout = v("extraction")
    assert t.num_heads % layout.tp == 0 and layout.workers * layout.tp == 8
    assert plan.totals["train_gpu_bytes_per_rank"] < 0.9 * plan.gpu.memory_bytes
    assert v("storage").dtype == ("fp8_e4m3" if t.hidden_size >= 6144 else "bfloat16")
    assert all(h > 0 for h in v("hours").values())
    assert all(d.reason for d in plan.decisions.values())


@pytest.mark.parametrize("gpu", ["h200", "b200", "b300", "rtx-pro-6000"])
def test_kimi_on_hopper_and_blackwell_nodes(gpu: str, tmp_path: Path) -> None:
    """The docs table: what fits on 8 GPUs of each kind (the arithmetic is in each reason)."""
    plan = plan_for("Kimi-K2.5", tmp_path, gpu=gpu)
    expected_tp = {"h200": 8, "b200": 4, "b300": 4, "rtx-pro-6000": 8}[gpu]
    assert (plan.value("max_length"), plan.value("zero")) == (32768, "zero2")
    assert plan.value("extraction").tp == expected_tp
    if gpu == "rtx-pro-6000":
        assert "no NVLink" in plan.decisions["extraction"].reason


def test_a_family_outside_the_list_is_refused_by_name(tmp_path: Path) -> None:
    for name in public_targets.REFUSED:
        with pytest.raises(PlanError, match=r"field 'model_type' is 'gemma2'.*not a family"):
            read_target(public_targets.model_dir(name, tmp_path))


# ---- the committed recipes are the planner's output ---------------------------------------------

GPU_RECIPES = {
    "llama-3.1-8b": ("Llama-3.1-8B-Instruct", "h100", "meta-llama/Llama-3.1-8B-Instruct"),
    "qwen3-8b": ("Qwen3-8B", "h100", "Qwen/Qwen3-8B"),
    "kimi-k2.5": ("Kimi-K2.5", "h200", "moonshotai/Kimi-K2.5"),
}
CPU_RECIPES = ["tiny", "tiny-mla", "tiny-agent", "tiny-recall"]
# The values a recipe's shell flags fix (its flags.sh, with recipes/dense-flags.sh where sourced).
FLAG_PATTERNS = {
    "samples": r'SAMPLES="\$\{SAMPLES:-(\d+)\}"',
    "max_length": r'MAX_LENGTH="\$\{MAX_LENGTH:-(\d+)\}"',
    "storage": r'STORAGE_DTYPE="\$\{STORAGE_DTYPE:-(\w+)\}"',
    "gpu_memory": r'GPU_MEMORY_GIB="\$\{GPU_MEMORY_GIB:-(\d+)\}"',
    "draft_vocab": r"--draft-vocab-size (\d+)",
    "max_tokens": r"--max-tokens (\d+)",
    "temperature": r"--temperature ([\d.]+) --top-p",
    "top_p": r"--top-p ([\d.]+)",
    "thinking": r"--thinking-fraction ([\d.]+)",
    "reasoning_parser": r"--reasoning-parser (\w+)",
    "tool_parser": r"--tool-call-parser (\w+)",
    "accelerate": r"ACCELERATE_ARGS=\(--config_file (recipes/accelerate/\w+\.yaml) --num",
    "planned_gpus": r"PLANNED_GPUS=(\d+)",
}


def flag_values(text: str) -> dict[str, str | None]:
    found = {k: re.search(p, text) for k, p in FLAG_PATTERNS.items()}
    return {k: m.group(1) if m else None for k, m in found.items()}


def committed_flags(recipe: str) -> str:
    text = (RECIPES / recipe / "flags.sh").read_text()
    if "source recipes/dense-flags.sh" in text:
        text += (RECIPES / "dense-flags.sh").read_text()
    return text


def train_values(text: str) -> dict[str, object]:
    def flat(d: dict, pre: str = "") -> dict[str, object]:
        out: dict[str, object] = {}
        for k, v in d.items():
            out.update(flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v})
        return out

    return flat(yaml.safe_load(text))


@pytest.mark.parametrize("recipe", GPU_RECIPES)
def test_a_committed_gpu_recipe_is_the_planners_output(recipe: str, tmp_path: Path) -> None:
    name, gpu, hub = GPU_RECIPES[recipe]
    facts = public_targets.facts(name)["config"]
    assert facts == json.loads((RECIPES / recipe / "target_config.json").read_text())
    plan = plan_for(name, tmp_path, gpu=gpu)
    assert train_values(train_yaml(plan, recipe, hub)) == train_values(
        (RECIPES / recipe / "train.yaml").read_text()
    )
    assert flag_values(gpu_flags(plan, recipe, hub)) == flag_values(committed_flags(recipe))
    tp = plan.value("extraction").tp
    committed_tp = "1" if tp == 1 else '"$NGPU"'
    assert f"--tensor-parallel-size {committed_tp}" in committed_flags(recipe)


@pytest.mark.parametrize("recipe", CPU_RECIPES)
def test_a_committed_tiny_recipe_is_the_planners_output(recipe: str) -> None:
    plan = make_plan(Request(RECIPES / recipe / "target", "cpu", gpus=1))
    generated = train_values(train_yaml(plan, recipe, recipe))
    assert generated == train_values((RECIPES / recipe / "train.yaml").read_text())
    # The tiny pipeline's defaults (max_length 512, draft_vocab 2048), or its flags.sh's.
    tiny = {"max_length": "512", "draft_vocab": "2048"}
    committed = RECIPES / recipe / "flags.sh"
    text = committed.read_text() if committed.is_file() else ""
    for key in tiny:
        found = re.search(rf"^{key}=(\d+)", text, re.M)
        written = re.search(rf"^{key}=(\d+)", cpu_flags(plan), re.M)
        assert written and written.group(1) == (found.group(1) if found else tiny[key])


# ---- the 1-GPU trap ---------------------------------------------------------------------------


def test_one_gpu_keeps_the_8b_recipes_step_and_lrs(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("recipe_targets", RECIPES / "recipe_targets.py")
    assert spec and spec.loader
    recipe_targets = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe_targets)
    recipe = RECIPES / "llama-3.1-8b"
    assert recipe_targets.accumulation_steps(recipe, 8, 8) == 1
    assert recipe_targets.accumulation_steps(recipe, 8, 1) == 8  # 8 x 8,192 = 65,536 per step
    with pytest.raises(
        recipe_targets.RecipeError, match=r"NGPU=3: .*65,536 tokens per step.*eagle3-recipe new"
    ):
        recipe_targets.accumulation_steps(recipe, 8, 3)
    with pytest.raises(recipe_targets.RecipeError, match=r"NGPU=16"):
        recipe_targets.accumulation_steps(recipe, 8, 16)
    # The planner, asked for one GPU, lands on the same step and lrs.
    one = plan_for("Llama-3.1-8B-Instruct", tmp_path, gpu="h100", gpus=1)
    assert one.value("gradient_accumulation_steps") == 8
    assert one.value("lr") == {"adamw": 1.0e-4, "muon": 3.0e-4}
    pipeline = (RECIPES / "llama-3.1-8b" / "pipeline.sh").read_text()
    # (NODES is 1 but in a recipe planned for several nodes: its step counts every node's GPUs)
    assert 'accumulation "$recipe" "$PLANNED_GPUS" "$((NGPU * NODES))"' in pipeline
    assert '--set train.gradient_accumulation_steps="$accumulation"' in pipeline


# ---- bad input --------------------------------------------------------------------------------


def _edit(folder: Path, file: str, **changes: object) -> None:
    data = json.loads((folder / file).read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    (folder / file).write_text(json.dumps(data))


def test_bad_target_folders_are_refused_naming_file_and_field(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match=r"config.json: missing"):
        read_target(tmp_path / "nothing")
    folder = public_targets.model_dir("Qwen3-8B", tmp_path)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(PlanError, match=r"config.json: unreadable"):
        read_target(folder)
    kimi_text = public_targets.facts("Kimi-K2.5")["config"]["text_config"]
    # (target, the file edited, its changes (None removes a key), the message expected)
    edits = [
        ("Qwen3-8B", "config.json", {"hidden_size": None}, r"field 'hidden_size'"),
        (
            "Qwen3-8B",
            "tokenizer_config.json",
            {"eos_token": None},
            r"tokenizer_config.json: field 'eos_token'",
        ),
        (
            "Qwen3-8B",
            "tokenizer_config.json",
            {"chat_template": None},
            r"field 'chat_template' is missing",
        ),
        (
            "Kimi-K2.5",
            "config.json",
            {"text_config": {k: v for k, v in kimi_text.items() if k != "kv_lora_rank"}},
            r"kv_lora_rank is missing: attention kind unknown",
        ),
    ]
    for i, (target, file, changes, message) in enumerate(edits):
        folder = public_targets.model_dir(target, tmp_path / f"edit-{i}")
        _edit(folder, file, **changes)
        with pytest.raises(PlanError, match=message):
            read_target(folder)


def test_a_vocabulary_that_disagrees_with_the_embedding_is_refused(tmp_path: Path) -> None:
    folder = public_targets.model_dir("Llama-3.2-1B-Instruct", tmp_path)
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {"a": 0, "b": 128300}}}))
    with pytest.raises(PlanError, match=r"id 128300.*field 'vocab_size' is 128256"):
        read_target(folder)
    (folder / "tokenizer.json").unlink()
    header = json.dumps(
        {
            "model.embed_tokens.weight": {
                "dtype": "BF16",
                "shape": [128000, 2048],
                "data_offsets": [0, 0],
            }
        }
    ).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(
        PlanError, match=r"'vocab_size' is 128256 but the checkpoint's embedding has 128000"
    ):
        read_target(folder)


def test_a_max_length_that_cannot_fit_names_the_largest_that_does(tmp_path: Path) -> None:
    with pytest.raises(
        PlanError, match=r"--max-length 262,144: does not fit .* largest that fits is 32,768"
    ):
        plan_for("Llama-3.1-8B-Instruct", tmp_path, gpu="h100", max_length=262144)


def test_a_small_gpu_gets_the_longest_sample_and_batch_that_fit(tmp_path: Path) -> None:
    # 0.9 x 18 GiB - 9.4 GB of state = 8.0 GB: 7,300 tokens at 1.1 MB -> 4,096, batch too
    plan = plan_for("Llama-3.1-8B-Instruct", tmp_path, gpu="h100", gpu_memory_gib=18)
    assert (plan.value("max_length"), plan.value("tokens_per_batch")) == (4096, 4096)
    assert plan.value("gradient_accumulation_steps") == 2  # 8 x 4,096 x 2 = 65,536 kept


def test_the_command_refuses_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    repo = tmp_path / "repo"
    (repo / "recipes" / "llama-3.1-8b").mkdir(parents=True)
    (repo / "recipes" / "llama-3.1-8b" / "pipeline.sh").write_text("#!/usr/bin/env bash\n")
    monkeypatch.chdir(repo)
    kimi = public_targets.model_dir("Kimi-K2.5", tmp_path)
    base = ["new", "--target", str(kimi), "--name", "mine"]
    cases = {
        "--disk-budget 0.5GB: below one shard": [*base, "--gpu", "h200", "--disk-budget", "500MB"],
        "6 does not divide num_attention_heads 64": [*base, "--gpu", "h200", "--gpus", "6"],
        "do not fit 1 node": [*base, "--gpu", "h100"],
        "the plan streams the hidden states": [*base, "--gpu", "h200", "--disk-budget", "2TB"],
    }
    for message, argv in cases.items():
        assert recipe_main(argv) == 2
        assert message.split(": ")[-1] in capsys.readouterr().err
        assert sorted(p.name for p in (repo / "recipes").iterdir()) == ["llama-3.1-8b"]
    assert recipe_main([*base, "--gpu", "h200", "--hub-id", "moonshotai/Kimi-K2.5"]) == 0
    written = repo / "recipes" / "mine"
    assert sorted(p.name for p in written.iterdir()) == [
        "flags.sh",
        "pipeline.sh",
        "plan.txt",
        "target_config.json",
        "train.yaml",
    ]
    assert sorted(p.name for p in (repo / "recipes").iterdir()) == ["llama-3.1-8b", "mine"]
    assert (written / "pipeline.sh").readlink() == Path("../llama-3.1-8b/pipeline.sh")
    config = load_config(written / "train.yaml")  # the trainer's own validation
    assert (config.train.lr, config.train.muon.lr) == (1.1e-4, 3.4e-4)
    assert recipe_main([*base, "--gpu", "h200"]) == 2  # never overwritten
    assert "exists" in capsys.readouterr().err


def test_several_nodes_are_refused_where_the_pipeline_cannot_run_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`new --nodes N` writes what pipeline.sh runs on N nodes (tests/test_generated_recipes.py);
    a layout it cannot start is refused before anything is written, naming why."""
    repo = tmp_path / "repo"
    (repo / "recipes" / "llama-3.1-8b").mkdir(parents=True)
    (repo / "recipes" / "llama-3.1-8b" / "pipeline.sh").write_text("#!/usr/bin/env bash\n")
    monkeypatch.chdir(repo)
    kimi = public_targets.model_dir("Kimi-K2.5", tmp_path)
    tiny = RECIPES / "tiny" / "target"
    cases = {
        # 2 x 8 H100s hold Kimi-K2.5 only as one engine over both nodes (PP 2, through Ray)
        "TP 8 x PP 2, one vLLM engine over several nodes": ["--target", str(kimi), "--gpu", "h100"],
        "the CPU recipes run on one machine": ["--target", str(tiny), "--gpu", "cpu"],
    }
    for message, argv in cases.items():
        assert recipe_main(["new", *argv, "--nodes", "2", "--name", "mine"]) == 2
        assert message in capsys.readouterr().err
        assert sorted(p.name for p in (repo / "recipes").iterdir()) == ["llama-3.1-8b"]
    # Two nodes of H200s hold it on each node: written, with the step and lrs of 16 GPUs.
    argv = ["new", "--target", str(kimi), "--gpu", "h200", "--nodes", "2", "--name", "mine"]
    assert recipe_main(argv) == 0
    flags = (repo / "recipes" / "mine" / "flags.sh").read_text()
    assert "NODES=2" in flags and "PLANNED_GPUS=16" in flags
    assert "--config_file recipes/accelerate/zero2_multinode.yaml" in flags
    config = load_config(repo / "recipes" / "mine" / "train.yaml")
    assert (config.train.lr, config.train.muon.lr) == (1.6e-4, 4.8e-4)  # the docs' x sqrt(2)


def test_every_gpu_kind_states_memory_flops_and_compute_capability() -> None:
    for key in ("h100", "h200", "b200", "b300", "rtx-pro-6000", "a100"):
        gpu = GPUS[key]
        assert gpu.memory_gib > 0 and gpu.bf16_tflops > 0 and "sm_" in gpu.compute_capability
    assert (GPUS["b300"].memory_gib, GPUS["rtx-pro-6000"].memory_gib) == (288, 96)
    assert math.isclose(gpu_kind("h100", 94).memory_gib, 94)
    with pytest.raises(PlanError, match="--gpu 'tpu'"):
        gpu_kind("tpu")


def test_an_embedded_target_presented_as_my_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A new user's two commands on CPU: the tiny target copied under another name, planned and
    written; the recipe is the tiny one's, run by the tiny pipeline."""
    import shutil

    mine = tmp_path / "my-model"
    shutil.copytree(RECIPES / "tiny" / "target", mine)
    repo = tmp_path / "repo"
    (repo / "recipes" / "llama-3.1-8b").mkdir(parents=True)
    (repo / "recipes" / "llama-3.1-8b" / "pipeline.sh").write_text("#!/usr/bin/env bash\n")
    monkeypatch.chdir(repo)
    assert recipe_main(["plan", "--target", str(mine), "--gpu", "cpu", "--gpus", "1"]) == 0
    assert "lr: adamw 1.0e-03, muon 5.0e-03" in capsys.readouterr().out
    argv = ["new", "--target", str(mine), "--gpu", "cpu", "--gpus", "1", "--name", "my-model"]
    assert recipe_main(argv) == 0
    folder = repo / "recipes" / "my-model"
    assert (folder / "pipeline.sh").readlink() == Path("../tiny/pipeline.sh")
    assert (folder / "target").resolve() == mine.resolve()
    generated = train_values((folder / "train.yaml").read_text())
    tiny = train_values((RECIPES / "tiny" / "train.yaml").read_text())
    paths = {"output_dir", "target.path", "data.hidden_states", "data.vocab_map"}
    assert {k: v for k, v in generated.items() if k not in paths} == {
        k: v for k, v in tiny.items() if k not in paths
    }
    assert generated["target.path"] == "recipes/my-model/target"
    assert "max_length=512\ndraft_vocab=2048\n" in (folder / "flags.sh").read_text()


DOC = ROOT / "docs" / "your-own-model.md"
DOC_ROWS = {
    "H200": "h200",
    "B200": "b200",
    "B300": "b300",
    "RTX PRO 6000 Blackwell": "rtx-pro-6000",
}


def test_the_docs_kimi_table_is_the_planners_output(tmp_path: Path) -> None:
    """docs/your-own-model.md's table, row by row, against the plan it was copied from."""
    rows = {
        cells[0]: cells
        for line in DOC.read_text().splitlines()
        if line.startswith("| ") and (cells := [c.strip() for c in line.strip("|").split("|")])
    }
    for label, gpu in DOC_ROWS.items():
        plan = plan_for("Kimi-K2.5", tmp_path, gpu=gpu)
        layout, hours = plan.value("extraction"), plan.value("hours")
        expected = [
            label,
            f"{plan.gpu.memory_gib:g}",
            plan.gpu.compute_capability.split(" ")[0],
            f"{plan.value('max_length'):,}",
            plan.value("zero").removeprefix("zero"),
            f"TP {layout.tp}, {layout.workers} worker"
            + ("s" if layout.workers > 1 else "")
            + ("" if plan.gpu.nvlink else " (PCIe, no NVLink)"),
            f"{layout.per_gpu_weights / 1e9:.1f} GB",
            rows[label][7],  # checked below: the GB left, then the KV tokens
            f"{plan.totals['train_gpu_bytes_per_rank'] / 1e9:.1f} GB",
            " / ".join(f"{hours[s]:.1f}" for s in ("regenerate", "extract", "train")),
        ]
        assert rows[label] == expected, label
        kv = layout.kv_tokens
        tokens = f"~{kv / 1e6:.1f}M" if kv >= 1e6 else f"~{round(kv / 1e3)}K"
        assert rows[label][7] == f"{layout.room / 1e9:.1f} GB ({tokens} tokens)"
    h100 = rows["H100"][5]
    assert "does not fit" in h100 and "≥ 88 GiB" in h100
    with pytest.raises(PlanError, match=r"GPUs of >= 88 GiB"):
        plan_for("Kimi-K2.5", tmp_path, gpu="h100")
