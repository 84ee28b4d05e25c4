"""Fuzzed ``draft.init_from`` reading: any config.json beside any set of weight names gives an
InitDraft or an InitFromError, never another exception.

The config is a plausible draft config of one of the three layouts (speculators, vLLM's MLA,
SGLang) with one field set to any JSON value or removed, or any text; the weight file holds a
random set of the names drafts use (``d2t`` and ``t2d`` of random sizes among them).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import save_file

from eagle3_train.export.init_from import InitDraft, InitFromError, read_init_draft

from support.fuzz import FUZZ, json_of, outcome

READER = "init_from (read_init_draft)"
SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-3, 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=5)
)
ANY_JSON = json_of(SCALARS)
LAYER = {"hidden_size": 16, "vocab_size": 32, "num_hidden_layers": 1, "intermediate_size": 32}
LAYOUTS = [
    {
        "speculators_model_type": "eagle3",
        "transformer_layer_config": dict(LAYER),
        "draft_vocab_size": 12,
        "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
    },
    {"architectures": ["Eagle3DeepseekV2ForCausalLM"], **LAYER, "draft_vocab_size": 32},
    {
        "architectures": ["LlamaForCausalLMEagle3"],
        **LAYER,
        "draft_vocab_size": 12,
        "target_hidden_size": 16,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    },
]
NAMES = [
    "d2t",
    "t2d",
    "fc.weight",
    "lm_head.weight",
    "layers.0.mlp.down_proj.weight",
    "midlayer.mlp.down_proj.weight",
    "additional_layers.0.x",
    "model.norm.weight",
]


def _paths(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*path, key))
    return out


@st.composite
def configs(draw: st.DrawFn) -> str:
    config = json.loads(json.dumps(draw(st.sampled_from(LAYOUTS))))
    path = draw(st.sampled_from(_paths(config)))
    if not path:
        return draw(st.text(max_size=20) | ANY_JSON.map(json.dumps))
    parent = config
    for key in path[:-1]:
        parent = parent[key]
    if draw(st.booleans()):
        del parent[path[-1]]
    else:
        parent[path[-1]] = draw(ANY_JSON)
    return json.dumps(config)


@FUZZ
@given(
    config=configs(),
    names=st.sets(st.sampled_from(NAMES), max_size=5),
    d2t_size=st.integers(0, 40),
    d2t_dtype=st.sampled_from(["int64", "float32", "bool"]),
)
def test_any_draft_directory_is_read_or_refused_by_name(
    config: str, names: set[str], d2t_size: int, d2t_dtype: str
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        draft = Path(tmp)
        (draft / "config.json").write_text(config, encoding="utf-8")
        tensors = {n: np.zeros((2, 2), np.float32) for n in names}
        if "d2t" in names:
            tensors["d2t"] = np.zeros(d2t_size, d2t_dtype)
        if "t2d" in names:
            tensors["t2d"] = np.ones(d2t_size, np.bool_)
        save_file(tensors, str(draft / "model.safetensors"))
        result = outcome(READER, lambda: read_init_draft(draft), (InitFromError,))
        if isinstance(result, InitDraft):
            assert result.target_vocab_size >= 1 and len(result.d2t) >= 0
        else:
            assert "draft.init_from" in str(result), result


# Minimal examples the property above found raising out of read_init_draft (JSONDecodeError,
# KeyError, TypeError, ValueError): each is an InitFromError naming the file and field now.
MLA = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], **LAYER, "draft_vocab_size": 32}


def _refusal(tmp_path: Path, config: str) -> str:
    (tmp_path / "config.json").write_text(config, encoding="utf-8")
    save_file({"fc.weight": np.zeros((2, 2), np.float32)}, str(tmp_path / "model.safetensors"))
    try:
        read_init_draft(tmp_path)
    except InitFromError as e:
        return str(e)
    raise AssertionError("read")


def test_config_that_is_not_json(tmp_path: Path) -> None:
    assert "config.json: not a UTF-8 JSON file" in _refusal(tmp_path, "")


def test_config_that_is_not_an_object(tmp_path: Path) -> None:
    assert "config.json: expected a JSON object, found list" in _refusal(tmp_path, "[]")


def test_config_without_hidden_size(tmp_path: Path) -> None:
    config = {k: v for k, v in MLA.items() if k != "hidden_size"}
    assert _refusal(tmp_path, json.dumps(config)).endswith("config.json: no hidden_size")


def test_speculators_config_without_vocab_size(tmp_path: Path) -> None:
    config = {**LAYOUTS[0], "transformer_layer_config": {}}
    assert _refusal(tmp_path, json.dumps(config)).endswith("config.json: no vocab_size")


def test_speculators_layer_config_that_is_not_an_object(tmp_path: Path) -> None:
    config = {**LAYOUTS[0], "transformer_layer_config": 3}
    assert "transformer_layer_config must be an object" in _refusal(tmp_path, json.dumps(config))


def test_size_that_is_not_a_positive_integer(tmp_path: Path) -> None:
    for value in ("32", 0, True, 1.5, [32]):
        message = _refusal(tmp_path, json.dumps({**MLA, "vocab_size": value}))
        assert f"vocab_size {value!r} must be a positive integer" in message, message
