"""Model folders the fuzzed planner (test_fuzz_target.py) and a read of its code found raising
something other than PlanError, or reading a wrong type as a fact; each minimal, each a
PlanError naming the file and the field now."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from eagle3_recipe.plan import Request, make_plan, plan_text
from eagle3_recipe.target import PlanError

from support import public_targets

LLAMA = "Llama-3.1-8B-Instruct"
KIMI = "Kimi-K2.5"
QWEN_MOE = "Qwen3-30B-A3B"


def _edit(folder: Path, name: str, edit: Any) -> None:
    path = folder / name
    data = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")


def _decoder(data: dict[str, Any]) -> dict[str, Any]:
    return data.get("text_config") or data


def _set(key: str, value: Any) -> Any:
    return lambda data: _decoder(data).__setitem__(key, value)


def _drop(key: str) -> Any:
    return lambda data: _decoder(data).pop(key)


TOKENIZER_JSON = {"model": {"vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 2}]}


def _tokenizer_json(**fields: Any) -> Any:
    return lambda data: data.update({**TOKENIZER_JSON, **fields})


# (target, file, edit, the refusal)
CASES = {
    # TypeError: int(None)
    "tokenizer.json vocab id null": (
        LLAMA,
        "tokenizer.json",
        _tokenizer_json(model={"vocab": {"a": None}}),
        r"tokenizer.json: field 'model.vocab' maps a token to null, not an id",
    ),
    # ValueError: int('x')
    "tokenizer.json vocab id text": (
        LLAMA,
        "tokenizer.json",
        _tokenizer_json(model={"vocab": {"a": "x"}}),
        r"tokenizer.json: field 'model.vocab' maps a token to \"x\"",
    ),
    # TypeError: 'int' object is not iterable
    "tokenizer.json added_tokens a number": (
        LLAMA,
        "tokenizer.json",
        _tokenizer_json(added_tokens=5),
        r"tokenizer.json: field 'added_tokens' is not a list of tokens with ids",
    ),
    # TypeError: string indices must be integers
    "tokenizer.json added_tokens of text": (
        LLAMA,
        "tokenizer.json",
        _tokenizer_json(added_tokens=["id"]),
        r"tokenizer.json: field 'added_tokens' is not a list",
    ),
    # AttributeError: 'list' object has no attribute 'get'
    "tokenizer.json model a list": (
        LLAMA,
        "tokenizer.json",
        _tokenizer_json(model=[1]),
        r"tokenizer.json: field 'model' is \[1\], not an object",
    ),
    # TypeError: 'int' object is not iterable
    "added_tokens_decoder a number": (
        LLAMA,
        "tokenizer_config.json",
        lambda data: data.update(added_tokens_decoder=7),
        r"tokenizer_config.json: field 'added_tokens_decoder' is 7, not an object",
    ),
    # ValueError: invalid literal for int() with base 10: '²' ("²".isdigit() is true)
    "added_tokens_decoder key a superscript digit": (
        LLAMA,
        "tokenizer_config.json",
        lambda data: data.update(added_tokens_decoder={"²": {}}),
        None,
    ),
    # TypeError: unhashable type: 'list'
    "a named template whose name is a list": (
        LLAMA,
        "tokenizer_config.json",
        lambda data: data.update(chat_template=[{"name": [], "template": "x"}]),
        r"tokenizer_config.json: field 'chat_template' is missing",
    ),
    # a number where the template goes was skipped for chat_template.jinja or "missing"
    "chat_template a number": (
        LLAMA,
        "tokenizer_config.json",
        lambda data: data.update(chat_template=3),
        r"tokenizer_config.json: field 'chat_template' is 3: not a template",
    ),
    # str(["x"]) was taken as the template
    "chat_template.json holding a list": (
        LLAMA,
        "chat_template.json",
        lambda data: data.update(chat_template=["x"]),
        r"chat_template.json: field 'chat_template' is \[\"x\"\], not a string",
    ),
    # TypeError: unhashable type: 'list'
    "model_type a list": (
        LLAMA,
        "config.json",
        _set("model_type", ["llama"]),
        r"config.json: field 'model_type' is \['llama'\]",
    ),
    # true read as 1
    "hidden_size true": (
        LLAMA,
        "config.json",
        _set("hidden_size", True),
        r"config.json: field 'hidden_size' is missing or not a positive integer",
    ),
    # ValueError: int('x') in num_kv_heads
    "num_key_value_heads text": (
        LLAMA,
        "config.json",
        _set("num_key_value_heads", "x"),
        r"config.json: field 'num_key_value_heads' is \"x\", not a positive integer",
    ),
    # TypeError in head_dim
    "head_dim a list": (
        LLAMA,
        "config.json",
        _set("head_dim", [128]),
        r"config.json: field 'head_dim' is \[128\], not a positive integer",
    ),
    # TypeError: int(None) for the MLP of a dense layer
    "intermediate_size null": (
        LLAMA,
        "config.json",
        _set("intermediate_size", None),
        r"config.json: field 'intermediate_size' is missing",
    ),
    # no error, but a negative MLA rank multiplied into the sizes
    "kv_lora_rank negative": (
        KIMI,
        "config.json",
        _set("kv_lora_rank", -1),
        r"config.json: field 'kv_lora_rank' is -1, not a positive integer",
    ),
    # KeyError: 'moe_intermediate_size'
    "experts without their size": (
        QWEN_MOE,
        "config.json",
        _drop("moe_intermediate_size"),
        r"config.json: field 'moe_intermediate_size' is missing in a config with 128 experts",
    ),
    # more dense layers than layers: negative MoE layers, negative sizes
    "first_k_dense_replace past the layers": (
        KIMI,
        "config.json",
        _set("first_k_dense_replace", 1000),
        r"config.json: field 'first_k_dense_replace' is 1000, more than num_hidden_layers 61",
    ),
    # "false" is true
    "tie_word_embeddings text": (
        LLAMA,
        "config.json",
        _set("tie_word_embeddings", "false"),
        r"config.json: field 'tie_word_embeddings' is \"false\", not true/false",
    ),
    # KeyError: 0 (architectures[0] of an object)
    "architectures an object": (
        LLAMA,
        "config.json",
        lambda data: data.update(architectures={"a": 1}),
        r"config.json: field 'architectures' is \{\"a\": 1\}, not a list of names",
    ),
    # AttributeError: 'list' object has no attribute 'get'
    "quantization_config a list": (
        LLAMA,
        "config.json",
        _set("quantization_config", []),
        r"config.json: field 'quantization_config' is \[\], not an object",
    ),
    # TypeError: float(None)
    "temperature null": (LLAMA, "generation_config.json", _set("temperature", None), None),
    # ValueError: float('hot')
    "temperature text": (
        LLAMA,
        "generation_config.json",
        _set("temperature", "hot"),
        r"generation_config.json: field 'temperature' is 'hot', not a number in \[0, 100\]",
    ),
    # NaN passed into the recipe's --temperature
    "top_p NaN": (
        LLAMA,
        "generation_config.json",
        _set("top_p", float("nan")),
        r"generation_config.json: field 'top_p' is nan, not a number in \[0, 1\]",
    ),
    # AttributeError: 'int' object has no attribute 'endswith'
    "weight_map a list": (
        LLAMA,
        "model.safetensors.index.json",
        lambda data: data.update(weight_map=[1]),
        r"model.safetensors.index.json: field 'weight_map' is not an object of file names",
    ),
    # TypeError: unsupported operand type(s) for /: 'PosixPath' and 'int'
    "weight_map naming a number": (
        LLAMA,
        "model.safetensors.index.json",
        lambda data: data.update(weight_map={"model.embed_tokens.weight": 1}),
        r"field 'weight_map' is not an object of file names",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_wrong_field_is_refused_by_name(tmp_path: Path, case: str) -> None:
    target, name, edit, refusal = CASES[case]
    folder = public_targets.model_dir(target, tmp_path)
    if name == "chat_template.json":  # read where tokenizer_config.json has no template
        _edit(folder, "tokenizer_config.json", lambda data: data.pop("chat_template"))
    _edit(folder, name, edit)
    request = Request(folder, "h200")
    if refusal is None:  # a value the planner reads, or skips, as the published files do
        plan_text(make_plan(request))
        return
    with pytest.raises(PlanError, match=refusal) as refused:
        make_plan(request)
    assert str(folder / name) in str(refused.value)


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("config.json", b"\xff{}"),  # UnicodeDecodeError was caught; nesting was not
        ("config.json", b"[" * 100_000),  # RecursionError
        ("tokenizer.json", b"[" * 100_000),
        ("chat_template.jinja", b"\xff\xfe{{ x }}"),  # UnicodeDecodeError
        ("generation_config.json", b"\xff"),  # UnicodeDecodeError
    ],
)
def test_an_unreadable_file_is_refused_by_name(tmp_path: Path, name: str, data: bytes) -> None:
    folder = public_targets.model_dir(LLAMA, tmp_path)
    if name == "chat_template.jinja":
        _edit(folder, "tokenizer_config.json", lambda d: d.pop("chat_template"))
    (folder / name).write_bytes(data)
    with pytest.raises(PlanError, match=rf"{folder / name}: unreadable"):
        make_plan(Request(folder, "h200"))


@pytest.mark.parametrize(
    "header",
    [
        b"\x01",  # struct.error: shorter than the length field
        struct.pack("<Q", 2**63) + b"{}",  # a length past the file: read tried 8 EiB
        struct.pack("<Q", 2) + b"[]",  # not an object
        struct.pack("<Q", 4) + b"\xff\xff\xff\xff",  # not UTF-8 JSON
        struct.pack("<Q", 43) + json.dumps({"model.embed_tokens.weight": {"shape": "x"}}).encode(),
    ],
)
def test_a_damaged_weight_header_is_refused_by_name(tmp_path: Path, header: bytes) -> None:
    folder = public_targets.model_dir(LLAMA, tmp_path)
    (folder / "model.safetensors").write_bytes(header)
    with pytest.raises(PlanError, match=rf"{folder / 'model.safetensors'}: not a readable"):
        make_plan(Request(folder, "h200"))
