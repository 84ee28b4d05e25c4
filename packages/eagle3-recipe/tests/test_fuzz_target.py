"""Fuzzed planner reading: a model folder whose config.json, tokenizer files (tokenizer_config.json,
tokenizer.json, chat_template.jinja / .json), generation_config.json or weight index is damaged
gives a plan or a ``PlanError`` naming the file, never another exception.

Each example starts from a published target's stand-in (tests/fixtures/public_targets, plus a
small tokenizer.json) and damages one or two of its files: one field set to any JSON value or
removed, the whole file replaced by any JSON value, by text or bytes (not UTF-8, not JSON), cut
short, or removed. The planner then plans it for a GPU node and for the CPU, and prints the plan.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from eagle3_recipe.plan import Request, make_plan, plan_text
from eagle3_recipe.target import PlanError

from support import public_targets
from support.fuzz import FUZZ, json_of, outcome, places

READER = "recipe planner (make_plan)"
TARGETS = [
    "Llama-3.1-8B-Instruct",
    "Qwen3-30B-A3B",
    "Kimi-K2.5",
    "DeepSeek-V3",
    "Mistral-7B-Instruct-v0.3",
]
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=5)
    | st.sampled_from(["12", "²", "1e3", "<think>", "{{ messages }}", "tools"])
)
ANY_JSON = json_of(SCALARS)
FILES = [
    "config.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
]


def _tokenizer_json(vocab_size: int) -> dict[str, Any]:
    return {
        "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}},
        "added_tokens": [{"id": vocab_size - 1, "content": "<eos>", "special": True}],
    }


def _model_dir(name: str, root: Path) -> Path:
    folder = public_targets.model_dir(name, root)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    vocab = (config.get("text_config") or config)["vocab_size"]
    (folder / "tokenizer.json").write_text(json.dumps(_tokenizer_json(vocab)), encoding="utf-8")
    return folder


def _damaged(value: Any, path: tuple[Any, ...], new: Any, remove: bool) -> Any:
    if not path:
        return new
    *parents, last = path
    node = value
    for key in parents:
        node = node[key]
    if remove:
        del node[last]
    else:
        node[last] = new
    return value


@st.composite
def damage(draw: st.DrawFn) -> tuple[str, str, Any]:
    """(file, how, what): how one file of the folder is damaged."""
    name = draw(st.sampled_from(FILES))
    how = draw(
        st.sampled_from(
            ["field", "field", "field", "remove", "json", "text", "bytes", "cut", "delete"]
        )
    )
    if how in ("field", "remove"):
        return name, how, (draw(st.integers(0, 10**6)), draw(ANY_JSON))
    if how == "json":
        return name, how, draw(ANY_JSON)
    if how == "text":
        return name, how, draw(st.text(max_size=40))
    if how == "bytes":
        return name, how, draw(st.binary(max_size=40))
    return name, how, draw(st.integers(0, 10**6))


def _apply(folder: Path, name: str, how: str, what: Any) -> None:
    path = folder / name
    if name == "chat_template.jinja" and not path.exists():
        path.write_text("{% for m in messages %}{{ m.content }}{% endfor %}", encoding="utf-8")
    if name == "chat_template.json" and not path.exists():
        path.write_text(json.dumps({"chat_template": "{{ messages }}"}), encoding="utf-8")
    if name == "model.safetensors.index.json" and not path.exists():
        index = {"weight_map": {"model.embed_tokens.weight": "model-00001.safetensors"}}
        path.write_text(json.dumps(index), encoding="utf-8")
    if not path.exists():
        path.write_text("{}", encoding="utf-8")
    if how == "delete":
        path.unlink()
    elif how == "text":
        path.write_text(what, encoding="utf-8")
    elif how == "bytes":
        path.write_bytes(what)
    elif how == "cut":
        data = path.read_bytes()
        path.write_bytes(data[: what % (len(data) + 1)])
    elif how == "json":
        path.write_text(json.dumps(what), encoding="utf-8")
    elif name != "chat_template.jinja":
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except ValueError:  # an earlier damage left no JSON to damage a field of
            return
        spots = places(value)
        spot = spots[what[0] % len(spots)]
        if how == "remove" and not spot:
            path.unlink()
            return
        path.write_text(
            json.dumps(_damaged(value, spot, what[1], how == "remove")), encoding="utf-8"
        )


@FUZZ
@given(
    target=st.sampled_from(TARGETS),
    damages=st.lists(damage(), min_size=1, max_size=2),
    gpu=st.sampled_from(["h200", "cpu"]),
)
def test_any_damaged_model_folder_is_planned_or_refused_by_name(
    target: str, damages: list[tuple[str, str, Any]], gpu: str
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = _model_dir(target, Path(tmp))
        for name, how, what in damages:
            _apply(folder, name, how, what)

        def plan() -> str:
            return plan_text(make_plan(Request(folder, gpu)))

        result = outcome(READER, plan, (PlanError,))
        if isinstance(result, PlanError):
            # a file of the folder is named, or (facts read, the node too small) the flag to change
            assert str(folder) in str(result) or "--" in str(result), result
