"""How a draft checkpoint's config reads, as vLLM reads it: the speculators ``eagle3``
layout (Llama-style ``Eagle3LlamaForCausalLM``) and vLLM's native MLA layout
(``Eagle3DeepseekV2ForCausalLM``) into one ``DraftSpec`` — shapes, flags, aux layer ids, the
tensors vLLM expects and those it does without. Every layout's reader takes the fields they
share from one builder (``_common_fields``) and sets only what its layout reads otherwise; the
MLA attention's own fields are ``mla_spec``'s. The forwards that run a spec are in ``draft.py``;
this module changes when a checkpoint format does, that one when vLLM's computation does."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from eagle3_eval.mla_spec import DraftFormatError, MLASpec
from eagle3_schemas.layouts.draft_layout import (
    SGLANG,
    SPECULATORS,
    VLLM_MLA,
    DraftLayoutError,
    Layout,
    detect_layout,
    sglang_to_vllm_names,
)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
LINEAGE_FILE = "eagle3.json"

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# vLLM 0.32 registry: both names are deepseek_eagle3.Eagle3DeepseekV2ForCausalLM.
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# SpeculativeConfig.hf_config_override turns these model types into DeepSeekMTPModel, which
# vLLM then cannot load as an EAGLE-3 draft ("Eagle3DeepSeekMTPModel not supported").
MTP_REWRITTEN_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# model_arch_config_convertor: the draft runs MLA only for these model types.
MLA_MODEL_TYPES = ("axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp")


def _checked_aux_ids(where: str, aux: Any) -> list[int]:
    """eagle_aux_hidden_state_layer_ids as vLLM needs them: non-negative ints, sorted, unique.
    vLLM collects the target's states for sorted(set(ids)), in that order: a draft whose fc
    was trained on another order (or on a repeated id) would be misfed silently."""
    if not aux or not all(isinstance(i, int) and i >= 0 for i in aux):
        raise DraftFormatError(
            f"{where}: eagle_aux_hidden_state_layer_ids {aux!r} must be non-negative ints"
        )
    if list(aux) != sorted(set(aux)):
        raise DraftFormatError(
            f"{where}: eagle_aux_hidden_state_layer_ids {aux} are not sorted and unique; "
            f"vLLM concatenates the target's states in the order {sorted(set(aux))}"
        )
    return list(aux)


def _common_fields(
    config: dict[str, Any],
    layer: dict[str, Any],
    need: Callable[[str], Any],
    hidden: int,
    heads: int,
    aux: list[int],
    notes: list[str],
    *,
    norm_before_residual: bool,
) -> dict[str, Any]:
    """The ``DraftSpec`` fields every layout reads the same way, as vLLM reads them.

    ``layer`` holds the decoder layer's keys (speculators: ``transformer_layer_config``; the flat
    layouts: the config itself) and ``need`` reads a required one with the layout's message;
    ``config`` holds the draft's own keys (the EAGLE-3 flags, ``target_hidden_size``,
    ``draft_vocab_size``). ``norm_before_residual`` is vLLM's default on the layout's route when
    the key is absent. A reader replaces what its layout reads otherwise."""
    target_vocab = int(need("vocab_size"))
    return {
        "hidden_size": hidden,
        "num_layers": int(layer.get("num_hidden_layers", 1)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(layer.get("num_key_value_heads") or heads),
        "head_dim": int(layer.get("head_dim") or hidden // heads),
        "intermediate_size": int(need("intermediate_size")),
        "rms_norm_eps": float(need("rms_norm_eps")),
        "hidden_act": str(layer.get("hidden_act", "silu")),
        "attention_bias": bool(layer.get("attention_bias", False)),
        "target_vocab_size": target_vocab,
        "draft_vocab_size": int(config.get("draft_vocab_size") or target_vocab),
        "target_hidden_size": int(config.get("target_hidden_size") or hidden),
        "aux_layer_ids": tuple(aux),
        "norm_before_residual": bool(config.get("norm_before_residual", norm_before_residual)),
        "norm_before_fc": bool(config.get("norm_before_fc", False)),
        "fc_norm": bool(config.get("fc_norm", False)),
        "norm_output": bool(config.get("norm_output", False)),
        "logit_scale": float(layer.get("logit_scale", config.get("logit_scale", 1.0))),
        "verifier_path": "",
        "layer_config": dict(layer),
        "vllm_notes": tuple(notes),
    }


@dataclass(frozen=True)
class DraftSpec:
    """What config.json of a draft checkpoint says, checked, with vLLM's defaults.

    Two formats: speculators ``eagle3`` (vLLM's Llama draft) and vLLM's native
    ``Eagle3DeepseekV2ForCausalLM`` config (the MLA draft, ``mla`` set). For the MLA draft
    ``head_dim`` is the query/key head size (nope + rope) and ``layer_config`` the whole config.
    """

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    target_vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, ...]
    norm_before_residual: bool
    norm_before_fc: bool
    fc_norm: bool
    norm_output: bool
    logit_scale: float
    verifier_path: str
    layer_config: dict[str, Any] = field(repr=False)
    # Things vLLM 0.32 would do differently from the config's face value; reported, not fatal.
    vllm_notes: tuple[str, ...] = ()
    mla: MLASpec | None = None
    # The layout config.json is in (eagle3_schemas.layouts.draft_layout) and what decided it; the aux
    # ids above are in vLLM's counting whatever the layout.
    layout: str = SPECULATORS
    layout_note: str = ""

    @property
    def num_aux(self) -> int:
        return len(self.aux_layer_ids)

    @property
    def kind(self) -> str:
        """``llama`` (speculators eagle3) or ``mla`` (Eagle3DeepseekV2ForCausalLM)."""
        return "llama" if self.mla is None else "mla"

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str = CONFIG_FILE) -> DraftSpec:
        try:
            layout = detect_layout(config, where)
        except DraftLayoutError as e:
            raise DraftFormatError(str(e)) from e
        if layout.name == VLLM_MLA:
            spec = cls.from_mla_config(config, where)
        elif layout.name == SGLANG:
            spec = cls.from_sglang_config(config, layout, where)
        else:
            spec = cls.from_speculators_config(config, where)
        return dataclasses.replace(spec, layout=layout.name, layout_note=layout.describe())

    @classmethod
    def from_sglang_config(
        cls, config: dict[str, Any], layout: Layout, where: str = CONFIG_FILE
    ) -> DraftSpec:
        """The SpecForge / SGLang layout (SGLang's ``llama_eagle3.py``): a flat Llama config;
        aux ids converted from SGLang's counting (``layout.aux_layer_ids``). SGLang's layer 0
        keeps the residual un-normed (``norm_before_residual`` false) and its fc reads three
        aux states; ``fc_norm`` / ``norm_output`` / ``norm_before_fc`` are read where present
        (SGLang itself has none of them)."""

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise DraftFormatError(f"{where}: missing {key} (SGLang layout)")
            return config[key]

        if layout.aux_layer_ids is None:
            raise DraftFormatError(
                f"{where}: missing eagle_config.eagle_aux_hidden_state_layer_ids (SGLang layout; "
                "SGLang would capture its default layers, which cannot be placed)"
            )
        aux = _checked_aux_ids(where, layout.aux_layer_ids)
        if int(config.get("num_hidden_layers", 1)) != 1:
            raise DraftFormatError(
                f"{where}: num_hidden_layers {config.get('num_hidden_layers')} in an SGLang-layout "
                "draft: SGLang's additional layers drop the residual where vLLM's keep it; only "
                "one-layer SGLang drafts are read"
            )
        if config.get("mlp_bias") or config.get("attention_bias"):
            raise DraftFormatError(f"{where}: attention_bias / mlp_bias are not supported")
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        notes = []
        if len(aux) != 3:
            notes.append(
                f"SGLang sizes fc for 3 aux states; this draft has {len(aux)} and would fail to "
                "load there"
            )
        # llama_eagle3.py (both engines): vLLM's native route defaults norm_before_residual to
        # False, and SGLang's layer 0 always keeps the un-normed residual. One layer and no
        # biases were checked above.
        return cls(
            **_common_fields(
                config, config, need, hidden, heads, aux, notes, norm_before_residual=False
            )
        )

    @classmethod
    def from_speculators_config(cls, config: dict[str, Any], where: str = CONFIG_FILE) -> DraftSpec:

        def need(obj: dict[str, Any], key: str, path: str = "") -> Any:
            if key not in obj:
                raise DraftFormatError(f"{where}: missing {path}{key}")
            return obj[key]

        if "speculators_model_type" not in config:
            raise DraftFormatError(
                f"{where}: neither a speculators eagle3 config (speculators_model_type) nor a "
                f"native MLA draft config (architectures {list(MLA_ARCHITECTURES)}); "
                f"architectures is {config.get('architectures')!r}"
            )
        if config.get("speculators_model_type") != "eagle3":
            raise DraftFormatError(
                f"{where}: speculators_model_type is {config.get('speculators_model_type')!r}, "
                "expected 'eagle3'"
            )
        layer = need(config, "transformer_layer_config")
        p = "transformer_layer_config."
        if layer.get("model_type", "llama") != "llama":
            raise DraftFormatError(
                f"{where}: {p}model_type {layer.get('model_type')!r} is not supported (this "
                "implementation follows vLLM's Llama EAGLE-3 draft)"
            )
        if layer.get("mlp_bias"):
            raise DraftFormatError(f"{where}: {p}mlp_bias is not supported")
        hidden = int(need(layer, "hidden_size", p))
        heads = int(need(layer, "num_attention_heads", p))
        aux = _checked_aux_ids(where, need(config, "eagle_aux_hidden_state_layer_ids"))
        notes = []
        if len(aux) != 3 and "num_aux_hidden_states" not in config:
            notes.append(
                f"vLLM 0.32 sizes fc for 3 aux states when a speculators config has no "
                f"num_aux_hidden_states; this draft has {len(aux)} and would fail to load there"
            )
        draft_vocab = int(need(config, "draft_vocab_size"))  # required in this layout
        verifier = config.get("speculators_config", {}).get("verifier", {})
        common = _common_fields(
            config,
            layer,
            lambda key: need(layer, key, p),
            hidden,
            heads,
            aux,
            notes,
            # vLLM's speculators conversion defaults this to True when the key is absent.
            norm_before_residual=True,
        )
        return cls(
            **common
            | {
                "draft_vocab_size": draft_vocab,
                "verifier_path": str(verifier.get("name_or_path", "")),
            }
        )

    @classmethod
    def from_mla_config(cls, config: dict[str, Any], where: str = CONFIG_FILE) -> DraftSpec:
        """vLLM's native config of ``Eagle3DeepseekV2ForCausalLM`` (deepseek_eagle3.py)."""

        def need(key: str) -> Any:
            if config.get(key) is None:
                raise DraftFormatError(f"{where}: missing {key}")
            return config[key]

        notes: list[str] = []
        model_type = config.get("model_type")
        if model_type in MTP_REWRITTEN_MODEL_TYPES:
            notes.append(
                f"model_type {model_type!r}: vLLM 0.32 rewrites it to deepseek_mtp for a draft and "
                "then fails to load Eagle3DeepSeekMTPModel; write model_type 'deepseek_v2'"
            )
        elif model_type not in MLA_MODEL_TYPES:
            notes.append(
                f"model_type {model_type!r}: vLLM 0.32 enables MLA only for model types "
                f"{list(MLA_MODEL_TYPES)}; write model_type 'deepseek_v2'"
            )
        hidden_act = str(config.get("hidden_act", "silu"))
        if hidden_act != "silu":
            raise DraftFormatError(
                f"{where}: hidden_act {hidden_act!r}; vLLM's DeepseekV2MLP supports only silu"
            )
        if config.get("attention_bias") or config.get("mlp_bias"):
            raise DraftFormatError(
                f"{where}: attention_bias / mlp_bias: vLLM's MLA draft has no biases (it drops "
                "them silently)"
            )
        if "index_topk" in config:
            raise DraftFormatError(
                f"{where}: index_topk turns on vLLM's DeepSeek-V3.2 sparse indexer, which this "
                "evaluator does not implement (and an EAGLE-3 draft should not use)"
            )
        if config.get("norm_before_fc"):
            notes.append(
                "norm_before_fc is set, but vLLM's MLA draft has no input_norm: it is ignored"
            )
        hidden = int(need("hidden_size"))
        heads = int(need("num_attention_heads"))
        kv_heads = config.get("num_key_value_heads")
        if kv_heads is not None and int(kv_heads) != heads:
            notes.append(
                f"num_key_value_heads {kv_heads} != num_attention_heads {heads}: MLA has no "
                "key/value head groups; vLLM ignores it"
            )
        eagle_config = config.get("eagle_config") or {}
        nested = eagle_config.get("eagle_aux_hidden_state_layer_ids")
        aux = config.get("eagle_aux_hidden_state_layer_ids", nested)
        if aux is None:
            raise DraftFormatError(
                f"{where}: missing eagle_aux_hidden_state_layer_ids (top level or in eagle_config)"
            )
        aux = _checked_aux_ids(where, aux)
        if "eagle_aux_hidden_state_layer_ids" in config:
            # Both lists: eagle_config in SGLang's counting (top - 1), or the legacy copy of the
            # top-level ids (SGLang would read it one layer off): the layout's note says which.
            try:
                note = detect_layout(config, where).note
            except DraftLayoutError as e:
                raise DraftFormatError(str(e)) from e
            if note:
                notes.append(note)
        # deepseek_eagle3.py: fc is sized from num_aux_hidden_states, else eagle_config's ids,
        # else 3 — never from the top-level ids.
        fc_aux = config.get("num_aux_hidden_states")
        if fc_aux is None:
            fc_aux = len(nested) if nested else 3
        if int(fc_aux) != len(aux):
            notes.append(
                f"vLLM 0.32 sizes this draft's fc for {fc_aux} aux states (num_aux_hidden_states "
                "or eagle_config.eagle_aux_hidden_state_layer_ids, default 3); the draft has "
                f"{len(aux)} and would fail to load there"
            )
        mla = MLASpec.from_config(config, where, notes)
        common = _common_fields(
            config,
            config,
            need,
            hidden,
            heads,
            aux,
            notes,
            # deepseek_eagle3.py: getattr(config, "norm_before_residual", False) on this route.
            norm_before_residual=False,
        )
        # MLA has no key/value head groups, and no input_norm (norm_before_fc is ignored);
        # hidden_act and the biases were checked above.
        return cls(
            **common
            | {
                "num_key_value_heads": heads,
                "head_dim": mla.qk_head_dim,
                "norm_before_fc": False,
                "mla": mla,
            }
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor name this draft may hold -> its shape."""
        h, i, mla = self.hidden_size, self.intermediate_size, self.mla
        fc_in = self.num_aux * self.target_hidden_size
        shapes: dict[str, tuple[int, ...]] = {
            "fc.weight": (h, fc_in),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
            "d2t": (self.draft_vocab_size,),
            "t2d": (self.target_vocab_size,),
            "embed_tokens.weight": (self.target_vocab_size, h),
        }
        if self.norm_before_fc and mla is None:
            shapes["input_norm.weight"] = (fc_in,)
        if self.fc_norm:
            for n in range(self.num_aux):
                shapes[f"fc_norm.{n}.weight"] = (self.target_hidden_size,)
        for n in range(self.num_layers):
            x_in = 2 * h if n == 0 else h
            prefix = f"layers.{n}."
            attn = prefix + "self_attn."
            if mla is None:
                shapes.update(self._llama_attention_shapes(attn, x_in))
            else:
                shapes.update(self._mla_attention_shapes(attn, x_in, mla))
            shapes[prefix + "mlp.gate_proj.weight"] = (i, h)
            shapes[prefix + "mlp.up_proj.weight"] = (i, h)
            shapes[prefix + "mlp.down_proj.weight"] = (h, i)
            shapes[prefix + "input_layernorm.weight"] = (h,)
            shapes[prefix + "post_attention_layernorm.weight"] = (h,)
            if n == 0 or mla is not None:  # vLLM builds hidden_norm in every MLA layer
                shapes[prefix + "hidden_norm.weight"] = (h,)
        return shapes

    def _llama_attention_shapes(self, attn: str, x_in: int) -> dict[str, tuple[int, ...]]:
        q_dim = self.num_attention_heads * self.head_dim
        kv_dim = self.num_key_value_heads * self.head_dim
        shapes = {
            attn + "q_proj.weight": (q_dim, x_in),
            attn + "k_proj.weight": (kv_dim, x_in),
            attn + "v_proj.weight": (kv_dim, x_in),
            attn + "o_proj.weight": (self.hidden_size, q_dim),
        }
        if self.attention_bias:
            for name, size in (("q", q_dim), ("k", kv_dim), ("v", kv_dim)):
                shapes[f"{attn}{name}_proj.bias"] = (size,)
        return shapes

    def _mla_attention_shapes(
        self, attn: str, x_in: int, mla: MLASpec
    ) -> dict[str, tuple[int, ...]]:
        heads = self.num_attention_heads
        return {
            attn + "q_a_proj.weight": (mla.q_lora_rank, x_in),
            attn + "q_a_layernorm.weight": (mla.q_lora_rank,),
            attn + "q_b_proj.weight": (heads * mla.qk_head_dim, mla.q_lora_rank),
            attn + "kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_rope_head_dim, x_in),
            attn + "kv_a_layernorm.weight": (mla.kv_lora_rank,),
            attn + "kv_b_proj.weight": (
                heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                mla.kv_lora_rank,
            ),
            attn + "o_proj.weight": (self.hidden_size, heads * mla.v_head_dim),
        }

    def optional_tensors(self) -> set[str]:
        """Tensors vLLM does without: shared from the target, derived, or ignored."""
        optional = {"embed_tokens.weight", "t2d"}
        if self.mla is not None:
            # vLLM builds hidden_norm in every MLA layer but only layer 0 uses it (and its
            # loader does not insist on it).
            optional |= {f"layers.{n}.hidden_norm.weight" for n in range(1, self.num_layers)}
        return optional | {"d2t"} if self.same_vocab else optional

    @property
    def same_vocab(self) -> bool:
        """A full vocabulary: its map is the identity, stored by no d2t (vLLM would refuse
        one: eagle3_schemas.layouts.draft_vocab; a draft written before that rule still reads)."""
        return self.draft_vocab_size == self.target_vocab_size


def checkpoint_names(spec: DraftSpec, tensors: dict[str, Tensor], where: str) -> dict[str, Tensor]:
    """The tensors under vLLM's names (an SGLang-layout draft's ``midlayer.*`` is
    ``layers.0.*``)."""
    if spec.layout != SGLANG:
        return tensors
    try:
        names = sglang_to_vllm_names(list(tensors), f"{where}: ")
    except DraftLayoutError as e:
        raise DraftFormatError(str(e)) from e
    return {names[n]: t for n, t in tensors.items()}


def vllm_view(directory: str | Path, workdir: str | Path) -> str:
    """The directory to hand vLLM as the draft. vLLM reads a flat config's aux ids as they are
    (top level, else ``eagle_config``), in its own counting: an SGLang-layout draft that states
    them only in SGLang's counting is served from a view under ``workdir`` whose config adds
    the top-level ids converted (eagle3_schemas.layouts.draft_layout); its weights are linked. Other
    drafts are served as they are."""
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8"))
    layout = detect_layout(config, str(directory / CONFIG_FILE))
    if layout.name != SGLANG or "eagle_aux_hidden_state_layer_ids" in config:
        return str(directory)
    view = Path(workdir) / "draft-vllm-view"
    view.mkdir(parents=True)
    for item in directory.iterdir():
        if item.name != CONFIG_FILE:
            (view / item.name).symlink_to(item.resolve())
    config["eagle_aux_hidden_state_layer_ids"] = layout.aux_layer_ids
    (view / CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    return str(view)


def read_spec(directory: str | Path) -> DraftSpec:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise DraftFormatError(f"{directory}: no {CONFIG_FILE}; not a draft checkpoint")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DraftFormatError(f"{path}: not valid JSON ({e})") from e
    return DraftSpec.from_config(config, str(path))
