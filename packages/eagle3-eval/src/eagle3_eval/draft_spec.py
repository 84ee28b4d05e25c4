"""How a draft checkpoint's config reads, as vLLM reads it: the speculators ``eagle3``
layout (Llama-style ``Eagle3LlamaForCausalLM``) and vLLM's native MLA layout
(``Eagle3DeepseekV2ForCausalLM``) into one ``DraftSpec`` — shapes, flags, aux layer ids, the
tensors vLLM expects and those it does without. The forwards that run a spec are in
``draft.py``; this module changes when a checkpoint format does, that one when vLLM's
computation does."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

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
MLA_ATTENTION = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLA_NORMS = ("q_a_layernorm", "kv_a_layernorm")
MLP = ("gate_proj", "up_proj", "down_proj")

# vLLM 0.32 registry: both names are deepseek_eagle3.Eagle3DeepseekV2ForCausalLM.
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# SpeculativeConfig.hf_config_override turns these model types into DeepSeekMTPModel, which
# vLLM then cannot load as an EAGLE-3 draft ("Eagle3DeepSeekMTPModel not supported").
MTP_REWRITTEN_MODEL_TYPES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
# model_arch_config_convertor: the draft runs MLA only for these model types.
MLA_MODEL_TYPES = ("axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_mtp")


class DraftFormatError(ValueError):
    """The checkpoint is not an EAGLE-3 draft this module (and vLLM) can run."""


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


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """DeepSeek YaRN's magnitude correction (vLLM ``yarn_get_mscale``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class MLASpec:
    """The multi-head latent attention of an ``Eagle3DeepseekV2ForCausalLM`` draft.

    ``rope_type`` is what vLLM runs: ``default`` or ``deepseek_yarn`` (any other type in the
    config is rewritten to it) or ``deepseek_llama_scaling`` (same rope, no softmax mscale;
    chosen when ``attention_factor`` is 1.0).
    """

    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """deepseek_v2.py DeepseekV2MLAAttention: qk_head_dim^-0.5 [* mscale^2 with yarn]."""
        scale = self.qk_head_dim**-0.5
        if self.rope_type == "deepseek_yarn":
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def rope_mscale(self) -> float:
        """Factor on cos/sin (DeepseekScalingRotaryEmbedding.mscale); 1 for plain rope."""
        if self.rope_type == "default":
            return 1.0
        return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(
            self.factor, self.mscale_all_dim
        )

    def inv_freq(self) -> Tensor:
        """[qk_rope_head_dim / 2] float32, as vLLM's rope cache is built."""
        dim, base = self.qk_rope_head_dim, self.rope_theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
        if self.rope_type == "default":
            return 1.0 / pos_freqs

        # DeepseekScalingRotaryEmbedding._compute_inv_freq (rotary_embedding/common.py helpers).
        def correction_dim(rotations: float) -> float:
            return (
                dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))
            ) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: the original frequency (extrapolation), 0: divided by factor
        interpolation, extrapolation = 1.0 / (self.factor * pos_freqs), 1.0 / pos_freqs
        return interpolation * (1 - keep) + extrapolation * keep

    @classmethod
    def from_config(cls, config: dict[str, Any], where: str, notes: list[str]) -> MLASpec:
        def need_int(key: str) -> int:
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise DraftFormatError(f"{where}: {key} must be a positive int, got {value!r}")
            return value

        if config.get("q_lora_rank") is None:
            # vLLM's hf_to_vllm_mapper renames kv_a_proj_with_mqa to fused_qkv_a_proj, which
            # only exists with a q_lora_rank: the checkpoint would not load.
            raise DraftFormatError(
                f"{where}: q_lora_rank is null; vLLM 0.32 cannot load an EAGLE-3 MLA draft "
                "without q_a_proj (its weight mapper needs fused_qkv_a_proj)"
            )
        rope = config.get("rope_parameters")
        legacy = config.get("rope_scaling")
        if not isinstance(rope, dict):
            rope = dict(legacy or {})
            rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
        elif isinstance(legacy, dict):
            for key, value in legacy.items():
                key = "rope_type" if key == "type" else key
                if key in rope and rope[key] != value:
                    notes.append(
                        f"rope_scaling.{key} {value!r} differs from rope_parameters.{key} "
                        f"{rope[key]!r}; the rope_parameters value is used"
                    )
        rope_type = str(rope.get("rope_type") or rope.get("type") or "default")
        theta = rope.get("rope_theta", config.get("rope_theta"))
        if theta is None:
            raise DraftFormatError(f"{where}: no rope_theta (rope_parameters.rope_theta)")
        dims = {
            key: need_int(key)
            for key in (
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
                "v_head_dim",
            )
        }
        if dims["qk_rope_head_dim"] % 2:
            raise DraftFormatError(f"{where}: qk_rope_head_dim must be even")
        if (dims["kv_lora_rank"], dims["qk_rope_head_dim"]) != (512, 64):
            notes.append(
                f"kv_lora_rank {dims['kv_lora_rank']} + qk_rope_head_dim "
                f"{dims['qk_rope_head_dim']}: vLLM 0.32's MLA backends (CPU_MLA, FlashMLA) need "
                "512 + 64 (cache head size 576)"
            )
        if config.get("rope_interleave") is False:
            notes.append(
                "rope_interleave is false, but vLLM 0.32 always applies interleaved (GPT-J) rope "
                "to an MLA draft; it is evaluated (as served) with interleaved rope"
            )
        if rope_type == "default":
            return cls(**dims, rope_theta=float(theta))
        if rope_type not in ("yarn", "deepseek_yarn"):
            notes.append(
                f"rope type {rope_type!r}: vLLM 0.32 runs every non-default rope of an MLA draft "
                "as DeepSeek YaRN; evaluated as such"
            )
        if "factor" not in rope:
            raise DraftFormatError(f"{where}: rope type {rope_type!r} without factor")
        original = rope.get("original_max_position_embeddings")
        if original is None:
            original = config.get("max_position_embeddings")
            notes.append(
                "rope parameters have no original_max_position_embeddings; "
                f"max_position_embeddings {original} is used"
            )
        if original is None:
            raise DraftFormatError(f"{where}: no original_max_position_embeddings for yarn")
        return cls(
            **dims,
            rope_theta=float(theta),
            rope_type=(
                "deepseek_llama_scaling" if rope.get("attention_factor") == 1.0 else "deepseek_yarn"
            ),
            factor=float(rope["factor"]),
            original_max_position_embeddings=int(original),
            beta_fast=float(rope.get("beta_fast", 32)),
            beta_slow=float(rope.get("beta_slow", 1)),
            mscale=float(rope.get("mscale", 1)),
            mscale_all_dim=float(rope.get("mscale_all_dim") or 0),
        )


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
        target_vocab = int(need("vocab_size"))
        notes = []
        if len(aux) != 3:
            notes.append(
                f"SGLang sizes fc for 3 aux states; this draft has {len(aux)} and would fail to "
                "load there"
            )
        return cls(
            hidden_size=hidden,
            num_layers=1,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(need("rms_norm_eps")),
            hidden_act=str(config.get("hidden_act", "silu")),
            attention_bias=False,
            target_vocab_size=target_vocab,
            draft_vocab_size=int(config.get("draft_vocab_size") or target_vocab),
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(aux),
            # llama_eagle3.py (both engines): vLLM's native route defaults it to False, and
            # SGLang's layer 0 always keeps the un-normed residual.
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            norm_before_fc=bool(config.get("norm_before_fc", False)),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_output=bool(config.get("norm_output", False)),
            logit_scale=float(config.get("logit_scale", 1.0)),
            verifier_path="",
            layer_config=dict(config),
            vllm_notes=tuple(notes),
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
        draft_vocab = int(need(config, "draft_vocab_size"))
        verifier = config.get("speculators_config", {}).get("verifier", {})
        return cls(
            hidden_size=hidden,
            num_layers=int(layer.get("num_hidden_layers", 1)),
            num_attention_heads=heads,
            num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
            head_dim=int(layer.get("head_dim") or hidden // heads),
            intermediate_size=int(need(layer, "intermediate_size", p)),
            rms_norm_eps=float(need(layer, "rms_norm_eps", p)),
            hidden_act=str(layer.get("hidden_act", "silu")),
            attention_bias=bool(layer.get("attention_bias", False)),
            target_vocab_size=int(need(layer, "vocab_size", p)),
            draft_vocab_size=draft_vocab,
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(aux),
            # vLLM's speculators conversion defaults this to True when the key is absent.
            norm_before_residual=bool(config.get("norm_before_residual", True)),
            norm_before_fc=bool(config.get("norm_before_fc", False)),
            fc_norm=bool(config.get("fc_norm", False)),
            norm_output=bool(config.get("norm_output", False)),
            logit_scale=float(layer.get("logit_scale", config.get("logit_scale", 1.0))),
            verifier_path=str(verifier.get("name_or_path", "")),
            layer_config=dict(layer),
            vllm_notes=tuple(notes),
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
        target_vocab = int(need("vocab_size"))
        return cls(
            hidden_size=hidden,
            num_layers=int(config.get("num_hidden_layers", 1)),
            num_attention_heads=heads,
            num_key_value_heads=heads,
            head_dim=mla.qk_head_dim,
            intermediate_size=int(need("intermediate_size")),
            rms_norm_eps=float(need("rms_norm_eps")),
            hidden_act=hidden_act,
            attention_bias=False,
            target_vocab_size=target_vocab,
            draft_vocab_size=int(config.get("draft_vocab_size") or target_vocab),
            target_hidden_size=int(config.get("target_hidden_size") or hidden),
            aux_layer_ids=tuple(aux),
            # deepseek_eagle3.py: getattr(config, "norm_before_residual", False) on this route.
            norm_before_residual=bool(config.get("norm_before_residual", False)),
            norm_before_fc=False,
            fc_norm=bool(config.get("fc_norm", False)),
            norm_output=bool(config.get("norm_output", False)),
            logit_scale=float(config.get("logit_scale", 1.0)),
            verifier_path="",
            layer_config=dict(config),
            vllm_notes=tuple(notes),
            mla=mla,
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
