"""What the planner knows about a target: its config.json, tokenizer and chat template, read
without loading a weight.

Every recipe setting is derived from these facts; a fact the planner needs and cannot find is a
``PlanError`` naming the file and the field, raised before any GPU work. A family outside
``FAMILIES`` is refused by name: its layer layout, its chat template's modes and vLLM's parsers
for it are facts, never guesses.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_schemas.layouts.target_config import text_config


class PlanError(ValueError):
    """A model directory, or a requested layout, the planner cannot plan a recipe for."""


@dataclass(frozen=True)
class Family:
    """What one family of targets brings: its attention kind and vLLM's parsers for it."""

    name: str
    attention: str  # "gqa" (Llama-style attention the draft copies) or "mla"
    reasoning_parser: str | None  # vLLM --reasoning-parser, where the template thinks
    tool_parser: str | None  # vLLM --tool-call-parser, where tool calls have marker tokens
    tool_parser_reason: str


QWEN_TOOLS = (
    "Qwen's calls sit in <tool_call> blocks (vLLM's hermes parser, Qwen's documented choice)"
)
# Keyed by the decoder's model_type (a wrapper's text_config for Kimi-K2.5).
FAMILIES: dict[str, Family] = {
    "llama": Family(
        "Llama 3.x",
        "gqa",
        None,
        None,
        "Llama 3.x writes a custom tool call as plain JSON text, no marker token: the answer's "
        "tokens as generated are what the draft trains on, no parser needed",
    ),
    "mistral": Family(
        "Mistral",
        "gqa",
        None,
        "mistral",
        "Mistral's calls follow its [TOOL_CALLS] token (vLLM's mistral parser)",
    ),
    "qwen2": Family("Qwen2.5", "gqa", None, "hermes", QWEN_TOOLS),
    "qwen3": Family("Qwen3", "gqa", "qwen3", "hermes", QWEN_TOOLS),
    "qwen3_moe": Family("Qwen3-MoE", "gqa", "qwen3", "hermes", QWEN_TOOLS),
    "deepseek_v3": Family(
        "DeepSeek-V3",
        "mla",
        "deepseek_r1",
        "deepseek_v3",
        "DeepSeek-V3's calls sit between its tool-call marker tokens (vLLM's deepseek_v3 parser)",
    ),
    "kimi_k2": Family(
        "Kimi-K2",
        "mla",
        "kimi_k2",
        "kimi_k2",
        "Kimi's calls sit in <|tool_calls_section_begin|> blocks (vLLM's kimi_k2 parser)",
    ),
}

REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


@dataclass(frozen=True)
class Tokenizer:
    eos_token: str
    chat_template: str
    max_token_id: int | None  # the largest id the tokenizer files name (None: not readable)

    @property
    def thinks(self) -> bool:
        """The template renders a reasoning block (Qwen3's, Kimi's <think>)."""
        return "<think>" in self.chat_template

    @property
    def thinking_switch(self) -> str | None:
        """The chat_template_kwargs name that turns thinking off, as the template reads it."""
        if not self.thinks:
            return None
        return "enable_thinking" if "enable_thinking" in self.chat_template else "thinking"

    @property
    def declares_tools(self) -> bool:
        return "tools" in self.chat_template


@dataclass(frozen=True)
class Target:
    """The facts of one target, each from its config.json or tokenizer files."""

    model_dir: Path
    config: dict[str, Any]  # the decoder's fields (a wrapper's text_config unwrapped)
    wrapper: dict[str, Any]  # the file's top level (the same dict for plain models)
    family_key: str
    tokenizer: Tokenizer
    embedding_rows: int | None = None  # from the safetensors header, where the weights are there
    remote_code: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def family(self) -> Family:
        return FAMILIES[self.family_key]

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def num_heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def num_kv_heads(self) -> int:
        return int(self.config.get("num_key_value_heads") or self.num_heads)

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.hidden_size // self.num_heads)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def mla(self) -> bool:
        return self.family.attention == "mla"

    @property
    def tied(self) -> bool:
        return bool(self.config.get("tie_word_embeddings", self.wrapper.get("tie_word_embeddings")))

    @property
    def max_position_embeddings(self) -> int:
        return int(self.config.get("max_position_embeddings") or 0)

    @property
    def kind(self) -> str:
        """The architecture name a reader recognises (the wrapper's, e.g. KimiK25...)."""
        names = self.wrapper.get("architectures") or self.config.get("architectures") or ["?"]
        return str(names[0])


# ---- reading ----------------------------------------------------------------------------------

# Fields the rules use beyond REQUIRED, each a count when present (null = absent). Positive:
# a size or a head count (0 has no meaning); the others may be 0 (no experts, no dense layer).
POSITIVE = (
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
    "q_lora_rank",
    "moe_intermediate_size",
    "num_experts_per_tok",
    *MLA_FIELDS,
)
COUNTS = ("n_routed_experts", "num_experts", "n_shared_experts", "first_k_dense_replace")
# A count past this is no model's: the sizes multiply several of them (and floats overflow).
LARGEST = 2**40


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= LARGEST


def read_target(model_dir: Path) -> Target:
    """The target's facts; ``PlanError`` naming the file and field of the first one missing."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    wrapper = _read_json(config_path)
    config = text_config(wrapper)
    family_key = _family_key(config_path, wrapper, config)
    for key in REQUIRED:
        if not _is_count(config.get(key)) or config[key] <= 0:
            raise PlanError(f"{config_path}: field '{key}' is missing or not a positive integer")
    _check_fields(config_path, wrapper, config)
    family = FAMILIES[family_key]
    has_mla = all(config.get(k) is not None for k in MLA_FIELDS)
    if family.attention == "mla" and not has_mla:
        missing = [k for k in MLA_FIELDS if config.get(k) is None]
        raise PlanError(
            f"{config_path}: model_type '{config['model_type']}' is an MLA family but "
            f"{', '.join(missing)} is missing: attention kind unknown, not guessed"
        )
    if family.attention == "gqa" and "kv_lora_rank" in config:
        raise PlanError(
            f"{config_path}: field 'kv_lora_rank' (MLA attention) in a {family.name} config: "
            "attention kind not one this planner knows for that family"
        )
    if family.attention == "gqa" and config.get("intermediate_size") is None:
        raise PlanError(f"{config_path}: field 'intermediate_size' is missing")
    tokenizer = read_tokenizer(model_dir)
    vocab = int(config["vocab_size"])
    if tokenizer.max_token_id is not None and tokenizer.max_token_id >= vocab:
        raise PlanError(
            f"{model_dir}: the tokenizer names id {tokenizer.max_token_id}, but "
            f"{config_path} field 'vocab_size' is {vocab}: the embedding has no row for it"
        )
    rows = embedding_rows(model_dir)
    if rows is not None and rows != vocab:
        raise PlanError(
            f"{config_path}: field 'vocab_size' is {vocab} but the checkpoint's embedding has "
            f"{rows} rows"
        )
    remote = "auto_map" in wrapper or any(model_dir.glob("tokenization_*.py"))
    return Target(model_dir, config, wrapper, family_key, tokenizer, rows, remote)


def _check_fields(path: Path, wrapper: dict[str, Any], config: dict[str, Any]) -> None:
    """Every optional field the rules read has the type they read it as (null = absent)."""
    for key in (*POSITIVE, *COUNTS):
        value = config.get(key)
        if value is not None and (not _is_count(value) or (key in POSITIVE and value == 0)):
            kind = "a positive" if key in POSITIVE else "a non-negative"
            raise PlanError(f"{path}: field '{key}' is {_short(value)}, not {kind} integer")
    experts = config.get("n_routed_experts") or config.get("num_experts")
    if experts and config.get("moe_intermediate_size") is None:
        raise PlanError(
            f"{path}: field 'moe_intermediate_size' is missing in a config with {experts} experts"
        )
    dense = config.get("first_k_dense_replace") or 0
    if dense > config["num_hidden_layers"]:
        raise PlanError(
            f"{path}: field 'first_k_dense_replace' is {dense}, more than num_hidden_layers "
            f"{config['num_hidden_layers']}"
        )
    if (dense or not experts) and config.get("intermediate_size") is None:
        raise PlanError(f"{path}: field 'intermediate_size' is missing (dense MLP layers)")
    for fields in (config, wrapper):
        for key, fits, expected in (
            ("tie_word_embeddings", lambda v: isinstance(v, bool), "true/false"),
            ("architectures", _names, "a list of names"),
            ("quantization_config", lambda v: isinstance(v, dict), "an object"),
        ):
            value = fields.get(key)
            if value is not None and not fits(value):
                raise PlanError(f"{path}: field '{key}' is {_short(value)}, not {expected}")


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


def _short(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise PlanError(f"{path}: missing (the target's config.json; give the model directory)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise PlanError(f"{path}: unreadable ({exc})") from exc
    if not isinstance(data, dict):
        raise PlanError(f"{path}: not a JSON object")
    return data


def _family_key(path: Path, wrapper: dict[str, Any], config: dict[str, Any]) -> str:
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in FAMILIES:
        return model_type
    known = ", ".join(FAMILIES)
    raise PlanError(
        f"{path}: field 'model_type' is {model_type!r} (architectures "
        f"{wrapper.get('architectures')}): not a family this planner knows ({known}). Each "
        "family brings its layer layout, chat-template modes and vLLM parsers; none is guessed"
    )


def read_tokenizer(model_dir: Path) -> Tokenizer:
    """EOS and chat template from tokenizer_config.json (or chat_template.jinja/.json)."""
    path = model_dir / "tokenizer_config.json"
    settings = _read_json(path) if path.is_file() else {}
    if not path.is_file() and not (model_dir / "tokenizer.json").is_file():
        raise PlanError(f"{path}: missing (no tokenizer files in {model_dir})")
    eos = settings.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str) or not eos:
        raise PlanError(f"{path}: field 'eos_token' is missing: a sample's end cannot be trained")
    template = _chat_template(model_dir, path, settings)
    if not template:
        raise PlanError(
            f"{path}: field 'chat_template' is missing (nor chat_template.jinja / .json beside "
            "it): the samples cannot be rendered as the target is served"
        )
    return Tokenizer(eos, template, _max_token_id(model_dir, path, settings))


def _chat_template(model_dir: Path, path: Path, settings: dict[str, Any]) -> str:
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {
            t.get("name"): t.get("template")
            for t in template
            if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
        template = named.get("default") or next(iter(named.values()), None)
    if template is not None and not isinstance(template, str):
        raise PlanError(
            f"{path}: field 'chat_template' is {_short(template)}: not a template (a string, or a "
            "list of {name, template})"
        )
    if template:
        return template
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():
        try:
            return jinja.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            raise PlanError(f"{jinja}: unreadable ({exc})") from exc
    as_json = model_dir / "chat_template.json"
    if as_json.is_file():
        template = _read_json(as_json).get("chat_template")
        if template is not None and not isinstance(template, str):
            raise PlanError(f"{as_json}: field 'chat_template' is {_short(template)}, not a string")
        return template or ""
    return ""


def _token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _max_token_id(model_dir: Path, config_path: Path, settings: dict[str, Any]) -> int | None:
    decoder = settings.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        raise PlanError(
            f"{config_path}: field 'added_tokens_decoder' is {_short(decoder)}, not an object"
        )
    ids = [int(k) for k in decoder if k.isascii() and k.isdigit()]
    path = model_dir / "tokenizer.json"
    if path.is_file():
        data = _read_json(path)
        model = data.get("model") or {}
        if not isinstance(model, dict):
            raise PlanError(f"{path}: field 'model' is {_short(model)}, not an object")
        vocab = model.get("vocab")
        if isinstance(vocab, dict):  # BPE / WordPiece; Unigram's is a list of [piece, score]
            wrong = [v for v in vocab.values() if not _token_id(v)]
            if wrong:
                raise PlanError(
                    f"{path}: field 'model.vocab' maps a token to {_short(wrong[0])}, not an id"
                )
            ids += vocab.values()
        added = data.get("added_tokens") or []
        if not isinstance(added, list) or not all(
            isinstance(t, dict) and _token_id(t.get("id")) for t in added
        ):
            raise PlanError(
                f"{path}: field 'added_tokens' is not a list of tokens with ids ({_short(added)})"
            )
        ids += [t["id"] for t in added]
    return max(ids) if ids else None


EMBEDDING_SUFFIX = "embed_tokens.weight"


def embedding_rows(model_dir: Path) -> int | None:
    """Rows of the input embedding, from the safetensors header alone (None: no weights here)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map") or {}
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise PlanError(f"{index}: field 'weight_map' is not an object of file names")
        names = [n for n in weight_map if n.endswith(EMBEDDING_SUFFIX)]
        if not names or not (model_dir / weight_map[names[0]]).is_file():
            return None
        return _rows(model_dir / weight_map[names[0]], names[0])
    single = model_dir / "model.safetensors"
    return _rows(single, None) if single.is_file() else None


def _rows(path: Path, name: str | None) -> int | None:
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > path.stat().st_size - 8:
                raise ValueError(f"its header length {length} runs past the file's end")
            header = json.loads(f.read(length))
        if not isinstance(header, dict):
            raise ValueError("its header is not a JSON object")
        for key, entry in header.items():
            if (key == name or (name is None and key.endswith(EMBEDDING_SUFFIX))) and isinstance(
                entry, dict
            ):
                shape = entry.get("shape")
                if isinstance(shape, list) and shape and _token_id(shape[0]):
                    return int(shape[0])
                raise ValueError(f"tensor {key!r} has no shape")
    except (OSError, ValueError, struct.error, RecursionError) as exc:
        raise PlanError(f"{path}: not a readable safetensors file ({exc})") from exc
    return None
