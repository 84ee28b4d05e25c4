"""Which public layout a draft directory is in, and the one rule that converts aux layer ids.

Three layouts of an EAGLE-3 draft's ``config.json`` are read by the stages:

- ``speculators``: the speculators ``eagle3`` config (``speculators_model_type: eagle3``, the
  layer under ``transformer_layer_config``), aux ids at the top level, vLLM's counting. What
  eagle3-train exports for the Llama-style draft; vLLM serves it.
- ``vllm-mla``: vLLM's native ``Eagle3DeepseekV2ForCausalLM`` config (flat). SGLang's MLA draft
  (``deepseek_eagle3.py``) has the same class name, so the config is read by both servers: the
  top-level ``eagle_aux_hidden_state_layer_ids`` in vLLM's counting (vLLM's target reads it
  first), ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's (SGLang's target reads
  only it; vLLM's draft only its length, to size fc) — see ``mla_eagle_config``.
- ``sglang``: the SpecForge / SGLang layout (``architectures: [LlamaForCausalLMEagle3]``, a
  flat Llama config, ``draft_vocab_size``, ``target_hidden_size``, aux ids under
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's counting); weights
  ``midlayer.*`` for layer 0 (SGLang's ``llama_eagle3.py``), ``fc``, ``norm``, ``lm_head``,
  ``d2t`` (``hot_token_id = d2t + arange``), ``t2d`` ignored.

The aux-id rule (stated here only): vLLM's id k is the residual stream *after* k decoder layers
(its target collects it before running layer k). SGLang's target captures before layer
``id + 1`` (``set_eagle3_layers_to_capture``: ``layers_to_capture = [id + 1 ...]``), so SGLang's
id j is vLLM's id ``j + 1``: vLLM [2, 30, 58] is SGLang [1, 29, 57]. Every reader converts
into vLLM's counting, which is what the hidden-state datasets and ``eagle3.json`` use, and names
the convention it found.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SPECULATORS = "speculators"
VLLM_MLA = "vllm-mla"
SGLANG = "sglang"
LAYOUTS = (SPECULATORS, VLLM_MLA, SGLANG)

# The counting each layout's aux ids are in.
VLLM_COUNTING = "vLLM (id k = the residual stream after k decoder layers)"
SGLANG_COUNTING = "SGLang (id j = vLLM's id j + 1: captured before layer j + 1)"
COUNTING = {SPECULATORS: VLLM_COUNTING, VLLM_MLA: VLLM_COUNTING, SGLANG: SGLANG_COUNTING}

SGLANG_ARCHITECTURES = ("LlamaForCausalLMEagle3",)
VLLM_MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# Keys only the speculators layout has: one of them in an SGLang config is a mixed layout.
SPECULATORS_KEYS = ("speculators_model_type", "transformer_layer_config", "speculators_config")
# SGLang's llama_eagle3.py names layer 0 ``midlayer``; vLLM's llama_eagle3.py maps it to
# ``layers.0`` (its load_weights: orig_to_new_substr {"midlayer.": "layers.0."}).
SGLANG_LAYER0 = "midlayer."
VLLM_LAYER0 = "layers.0."


class DraftLayoutError(ValueError):
    """A draft directory's config matches no layout, or mixes them, or its aux ids cannot be
    placed."""


def sglang_to_vllm_ids(ids: Sequence[int]) -> list[int]:
    """SGLang's aux ids in vLLM's counting (the rule: + 1)."""
    return [int(i) + 1 for i in ids]


def vllm_to_sglang_ids(ids: Sequence[int], where: str = "") -> list[int]:
    """vLLM's aux ids in SGLang's counting (- 1). vLLM's id 0 (the embedding output) has no
    SGLang id: refused, naming both conventions."""
    if any(int(i) < 1 for i in ids):
        raise DraftLayoutError(
            f"{where}aux layer ids {list(ids)} in {VLLM_COUNTING} include 0 (the embedding "
            f"output), which has no id in {SGLANG_COUNTING}; the draft cannot be written for SGLang"
        )
    return [int(i) - 1 for i in ids]


@dataclass(frozen=True)
class Layout:
    """What a draft config says about itself."""

    name: str  # one of LAYOUTS
    counting: str
    aux_ids_as_written: list[int] | None
    aux_layer_ids: list[int] | None  # vLLM's counting
    deciding_fields: tuple[str, ...]
    note: str = ""  # what a server other than vLLM would read wrongly in it; "" when nothing

    def describe(self) -> str:
        ids = (
            f"aux ids {self.aux_ids_as_written} in {self.counting}"
            + (
                f" = {self.aux_layer_ids} in vLLM's counting"
                if self.aux_layer_ids != self.aux_ids_as_written
                else ""
            )
            if self.aux_ids_as_written is not None
            else "no aux ids"
        )
        note = f"; {self.note}" if self.note else ""
        return f"{self.name} layout (decided by {', '.join(self.deciding_fields)}); {ids}{note}"


def mla_eagle_config(aux_layer_ids: Sequence[int], where: str = "") -> dict[str, Any]:
    """``eagle_config`` of an MLA draft whose top-level ids are ``aux_layer_ids`` (vLLM's
    counting): the same ids in SGLang's counting, which SGLang's target captures (model_runner
    reads ``eagle_config.eagle_aux_hidden_state_layer_ids`` and captures before layer id + 1)
    and whose length vLLM's ``deepseek_eagle3.py`` sizes fc from. vLLM's id 0 is refused."""
    return {"eagle_aux_hidden_state_layer_ids": vllm_to_sglang_ids(aux_layer_ids, where)}


def _mla_ids(where: str, top: list[int], nested: list[int] | None) -> str:
    """The note on an MLA config's two id lists (top: vLLM's counting), or a refusal."""
    if nested is None:
        return (
            "no eagle_config.eagle_aux_hidden_state_layer_ids: SGLang would capture its default "
            "layers, and vLLM sizes fc for 3 aux states unless num_aux_hidden_states says"
        )
    if min(top, default=1) >= 1 and nested == vllm_to_sglang_ids(top):
        return ""
    if nested == top:
        fix = (
            f"write {vllm_to_sglang_ids(top)} under eagle_config"
            if min(top, default=1) >= 1
            else "vLLM's id 0 has no SGLang id: SGLang cannot serve it"
        )
        return (
            f"eagle_config.eagle_aux_hidden_state_layer_ids {nested} repeat the top-level ids "
            f"({VLLM_COUNTING}) where SGLang reads its own counting: SGLang would feed the draft "
            "layers one off (it captures before layer id + 1); vLLM reads the top level and is "
            f"right. Re-export, or {fix}"
        )
    raise DraftLayoutError(
        f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {nested} are neither the "
        f"top-level eagle_aux_hidden_state_layer_ids {top} ({VLLM_COUNTING}) in "
        f"{SGLANG_COUNTING} (id - 1) nor the same list; vLLM and SGLang would read different "
        "layers, and which the draft was trained on cannot be told"
    )


def _ids(where: str, field: str, value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value
    ):
        raise DraftLayoutError(f"{where}: {field} {value!r} must be a list of non-negative ints")
    return list(value)


def detect_layout(config: Mapping[str, Any], where: str = "config.json") -> Layout:
    """The layout of a parsed draft ``config.json``; refused (naming the fields that decided it)
    when it matches none or mixes them, or when its aux ids are stated twice in two counts."""
    architectures = config.get("architectures")
    if architectures is not None and not isinstance(architectures, list):
        raise DraftLayoutError(
            f"{where}: architectures {architectures!r} must be a list of class names"
        )
    archs = [a for a in (architectures or []) if isinstance(a, str)]
    spec_keys = [k for k in SPECULATORS_KEYS if k in config]
    sglang = [a for a in archs if a in SGLANG_ARCHITECTURES]
    mla = [a for a in archs if a in VLLM_MLA_ARCHITECTURES]
    eagle_config = config.get("eagle_config")
    nested = (
        eagle_config.get("eagle_aux_hidden_state_layer_ids")
        if isinstance(eagle_config, dict)
        else None
    )
    top = config.get("eagle_aux_hidden_state_layer_ids")
    found = [
        name for name, hit in ((SPECULATORS, spec_keys), (SGLANG, sglang), (VLLM_MLA, mla)) if hit
    ]
    fields = [*(f"{k}" for k in spec_keys), *(f"architectures {a!r}" for a in sglang + mla)]
    if len(found) > 1:
        raise DraftLayoutError(
            f"{where}: mixes draft layouts {found} ({'; '.join(fields)}); a draft config is one "
            f"of {list(LAYOUTS)}, and its aux ids would be read in two counts "
            f"({VLLM_COUNTING} vs {SGLANG_COUNTING})"
        )
    if not found:
        raise DraftLayoutError(
            f"{where}: matches no draft layout: no speculators_model_type / "
            f"transformer_layer_config (speculators), architectures {archs!r} names neither "
            f"{list(SGLANG_ARCHITECTURES)} (SGLang / SpecForge) nor "
            f"{list(VLLM_MLA_ARCHITECTURES)} (vLLM's native MLA)"
        )
    name = found[0]
    if name == SPECULATORS:
        if config.get("speculators_model_type") != "eagle3":
            raise DraftLayoutError(
                f"{where}: speculators_model_type is {config.get('speculators_model_type')!r}, "
                "expected 'eagle3'"
            )
        ids = _ids(where, "eagle_aux_hidden_state_layer_ids", top)
        return Layout(name, VLLM_COUNTING, ids, ids, tuple(fields))
    if name == VLLM_MLA:
        # SGLang's MLA draft has the same class name (its deepseek_eagle3.py) and reads
        # eagle_config's ids in SGLang's counting; vLLM reads the top level first, else the same
        # eagle_config ids in its own. Ids under eagle_config only cannot be placed; both lists
        # must say the same layers (eagle_config = top - 1), or the legacy copy (a note).
        if top is None and nested is not None:
            raise DraftLayoutError(
                f"{where}: architectures {mla} with aux ids only under "
                f"eagle_config.eagle_aux_hidden_state_layer_ids ({nested}): SGLang reads them in "
                f"{SGLANG_COUNTING}, vLLM in {VLLM_COUNTING}; which count they are in cannot be "
                "told. State them at the top level (eagle_aux_hidden_state_layer_ids) in vLLM's "
                "counting: SGLang's id + 1 for a SpecForge-trained draft, as they are for vLLM's"
            )
        ids = _ids(where, "eagle_aux_hidden_state_layer_ids", top)
        if ids is None:
            return Layout(name, VLLM_COUNTING, None, None, tuple(fields))
        nested_ids = _ids(where, "eagle_config.eagle_aux_hidden_state_layer_ids", nested)
        note = _mla_ids(where, ids, nested_ids)
        return Layout(name, VLLM_COUNTING, ids, ids, tuple(fields), note)
    # SGLang: ids in eagle_config, SGLang's counting. A top-level list is vLLM's reading of the
    # same draft; it must say the same ids converted, else the draft cannot be placed.
    written = _ids(where, "eagle_config.eagle_aux_hidden_state_layer_ids", nested)
    top_ids = _ids(where, "eagle_aux_hidden_state_layer_ids", top)
    if written is None and top_ids is not None:
        raise DraftLayoutError(
            f"{where}: an SGLang-layout config (architectures {sglang}) with aux ids only at the "
            f"top level ({top_ids}): SGLang reads eagle_config.eagle_aux_hidden_state_layer_ids "
            f"({SGLANG_COUNTING}), vLLM the top level ({VLLM_COUNTING}); which count they are "
            "in cannot be told"
        )
    converted = sglang_to_vllm_ids(written) if written is not None else None
    if top_ids is not None and top_ids != converted:
        raise DraftLayoutError(
            f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids {written} ({SGLANG_COUNTING}) "
            f"is {converted} in vLLM's counting, but the top-level "
            f"eagle_aux_hidden_state_layer_ids says {top_ids} ({VLLM_COUNTING}); the ids cannot "
            "be placed"
        )
    decided = (*fields, "eagle_config.eagle_aux_hidden_state_layer_ids")
    return Layout(name, SGLANG_COUNTING, written, converted, decided)


_SGLANG_EXTRA = re.compile(r"^additional_layers\.")


def sglang_to_vllm_names(names: Sequence[str], where: str = "") -> dict[str, str]:
    """SGLang tensor name -> vLLM's (``midlayer.`` -> ``layers.0.``); ``model.`` prefixes
    dropped. SGLang's later layers (``additional_layers.*``) compute differently from vLLM's
    (they drop the residual), so a draft holding them is refused."""
    out: dict[str, str] = {}
    for name in names:
        bare = name[len("model.") :] if name.startswith("model.") else name
        if _SGLANG_EXTRA.match(bare):
            raise DraftLayoutError(
                f"{where}tensor {name!r}: SGLang's additional draft layers drop the residual "
                "where vLLM's keep it; a multi-layer SGLang draft is not read"
            )
        if bare.startswith(VLLM_LAYER0):
            raise DraftLayoutError(
                f"{where}tensor {name!r} uses vLLM's name in an SGLang-layout draft (layer 0 is "
                f"{SGLANG_LAYER0!r} there); the weights mix layouts"
            )
        out[name] = (
            VLLM_LAYER0 + bare[len(SGLANG_LAYER0) :] if bare.startswith(SGLANG_LAYER0) else bare
        )
    return out


def vllm_to_sglang_name(name: str) -> str:
    return SGLANG_LAYER0 + name[len(VLLM_LAYER0) :] if name.startswith(VLLM_LAYER0) else name


# SGLang's one-layer LlamaForCausalLMEagle3 (python/sglang/srt/models/llama_eagle3.py): its
# parameters, and the checkpoint-name rewrites of its load_weights (stacked q/k/v and
# gate/up; a name not among its parameters, tried bare and under ``model.``, is skipped
# silently). ``d2t`` becomes ``hot_token_id``; ``t2d`` is skipped on purpose.
SGLANG_PARAMETERS = frozenset(
    {
        "model.embed_tokens.weight",
        "model.fc.weight",
        "model.midlayer.self_attn.qkv_proj.weight",
        "model.midlayer.self_attn.o_proj.weight",
        "model.midlayer.mlp.gate_up_proj.weight",
        "model.midlayer.mlp.down_proj.weight",
        "model.midlayer.input_layernorm.weight",
        "model.midlayer.post_attention_layernorm.weight",
        "model.midlayer.hidden_norm.weight",
        "model.norm.weight",
        "lm_head.weight",
    }
)
SGLANG_STACKED = (
    (".qkv_proj", ".q_proj"),
    (".qkv_proj", ".k_proj"),
    (".qkv_proj", ".v_proj"),
    (".gate_up_proj", ".gate_proj"),
    (".gate_up_proj", ".up_proj"),
)


def sglang_loads(name: str) -> str | None:
    """The parameter SGLang's ``load_weights`` puts checkpoint tensor ``name`` into (``d2t``:
    ``hot_token_id``), None where it skips it (``t2d`` included)."""
    if "d2t" in name:
        return "hot_token_id"
    if "t2d" in name:
        return None
    for param, shard in SGLANG_STACKED:
        if shard in name:
            name = name.replace(shard, param)
            break
    for candidate in (name, f"model.{name}"):
        if candidate in SGLANG_PARAMETERS:
            return candidate
    return None
