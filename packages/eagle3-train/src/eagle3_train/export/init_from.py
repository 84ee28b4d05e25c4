"""Start from a published draft (``draft.init_from``): read it, check it fits this run, load it.

Reads the layouts public EAGLE-3 drafts use (eagle3_schemas.layouts.draft_layout decides which, and
refuses a config that matches none or mixes them): the speculators ``eagle3`` config
(Llama-style layer) and vLLM's native MLA config (``Eagle3DeepseekV2ForCausalLM``), weights
under vLLM's names (what eagle3-train exports); and the SpecForge / SGLang layout
(``LlamaForCausalLMEagle3``, e.g. lightseekorg/kimi-k2.5-eagle3), whose aux ids are converted
from SGLang's counting and whose ``midlayer.*`` tensors are layer 0. The layout found is named
in the preflight and recorded in the new draft's lineage (``init_from_layout``).
Before any step the draft's architecture, hidden size, aux layer ids, target vocabulary and
layer shapes are compared with this run's, and a mismatch is refused naming both sides.

The draft vocabulary: when the draft's ``d2t`` differs from this run's vocabulary map the start
is refused unless ``draft.remap_vocab``; then the LM-head rows of target tokens both
vocabularies hold are carried over, the others keep the target's rows (the usual start), and
the count is reported. A full-vocabulary draft stores no ``d2t`` (its map is the identity, the
rule of eagle3_schemas.layouts.draft_vocab, as the public Kimi-K2.5 drafts are published); one written
before that rule, with the ``d2t`` vLLM refuses, still starts a run, with a note.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from eagle3_schemas.contract.lineage import fingerprint_file, fingerprint_json
from eagle3_schemas.layouts.draft_layout import (
    SGLANG,
    DraftLayoutError,
    detect_layout,
    sglang_to_vllm_names,
)
from eagle3_schemas.layouts.draft_vocab import checkpoint_vocab_map, serving_problems
from eagle3_train.model.arch import DraftArch

MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"


class InitFromError(ValueError):
    """The starting draft cannot start this run."""


@dataclass
class InitDraft:
    path: Path
    architecture: str  # llama | mla
    hidden_size: int
    aux_layer_ids: list[int] | None
    target_vocab_size: int
    draft_vocab_size: int
    num_layers: int
    d2t: np.ndarray
    # the norms of fc's input: each adds weights of its own (model/draft.py)
    norm_before_fc: bool = False
    fc_norm: bool = False
    layout: str = "speculators"  # eagle3_schemas.layouts.draft_layout
    layout_note: str = ""
    # Stated by the SGLang layout (its layer 0 never norms the residual); None: not compared.
    norm_before_residual: bool | None = None
    # What the preflight reports beside the fit: a tensor vLLM would not load, say.
    notes: tuple[str, ...] = ()

    def vllm_names(self, names: list[str], where: str) -> dict[str, str]:
        """Checkpoint tensor name -> this trainer's (= vLLM's) name."""
        if self.layout != SGLANG:
            return {n: n for n in names}
        try:
            return sglang_to_vllm_names(names, f"{where}: ")
        except DraftLayoutError as e:
            raise InitFromError(f"draft.init_from {e}") from e

    @property
    def target_ids(self) -> np.ndarray:
        return np.arange(len(self.d2t), dtype=np.int64) + self.d2t


def read_init_draft(path: str | Path) -> InitDraft:
    """The starting draft's config and vocabulary (weights are read later, by ``load_into``)."""
    path = Path(path)
    config_file, weights = path / "config.json", path / "model.safetensors"
    for f in (config_file, weights):
        if not f.is_file():
            raise InitFromError(
                f"draft.init_from {path}: no {f.name}; expected a draft directory in the "
                "speculators eagle3 or vLLM-native MLA layout (config.json + model.safetensors)"
            )
    where = f"draft.init_from {config_file}"
    try:
        cfg = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as e:  # not UTF-8 or not JSON
        raise InitFromError(f"{where}: not a UTF-8 JSON file ({e})") from e
    if not isinstance(cfg, dict):
        raise InitFromError(f"{where}: expected a JSON object, found {type(cfg).__name__}")
    try:
        layout = detect_layout(cfg, f"draft.init_from {config_file}")
    except DraftLayoutError as e:
        raise InitFromError(str(e)) from e
    aux = layout.aux_layer_ids  # vLLM's counting, whatever the layout wrote
    norm_before_residual = None
    if layout.name == "speculators":
        layer = cfg.get("transformer_layer_config", {})
        if not isinstance(layer, dict):
            raise InitFromError(f"{where}: transformer_layer_config must be an object")
        architecture = "llama"
    elif layout.name == SGLANG:
        layer = cfg
        architecture = "llama"
        norm_before_residual = bool(cfg.get("norm_before_residual", False))
        if _size(cfg, "num_hidden_layers", where, 1) != 1:
            raise InitFromError(
                f"draft.init_from {config_file}: num_hidden_layers {cfg.get('num_hidden_layers')} "
                "in an SGLang-layout draft: SGLang's additional layers drop the residual where "
                "this trainer's keep it; only one-layer SGLang drafts are read"
            )
    else:
        layer = cfg
        architecture = "mla"
    with safe_open(str(weights), "pt") as f:
        if layout.name == SGLANG:
            try:  # refuses a mixed or multi-layer weight file before anything is loaded
                sglang_to_vllm_names(list(f.keys()), f"draft.init_from {weights}: ")
            except DraftLayoutError as e:
                raise InitFromError(str(e)) from e
        names = set(f.keys())
        target_vocab = _size(layer, "vocab_size", where)
        draft_vocab = _size(cfg, "draft_vocab_size", where, target_vocab)
        try:
            d2t, _ = checkpoint_vocab_map(
                names, lambda n: f.get_tensor(n).numpy(), draft_vocab, target_vocab
            )
        except KeyError as e:
            raise InitFromError(
                f"draft.init_from {weights}: {e.args[0]} (vLLM would map draft ids onto the "
                "first target ids)"
            ) from e
    notes = tuple(
        f"draft.init_from {weights}: tensor {name}: {why}; this run's export stores none"
        for name, why in serving_problems(names, draft_vocab, target_vocab)
    )
    return InitDraft(
        path=path,
        architecture=architecture,
        hidden_size=_size(cfg, "target_hidden_size", where, None)
        or _size(layer, "hidden_size", where),
        aux_layer_ids=list(aux) if aux else None,
        target_vocab_size=target_vocab,
        draft_vocab_size=draft_vocab,
        num_layers=_size(layer, "num_hidden_layers", where, 1),
        d2t=d2t,
        norm_before_fc=bool(cfg.get("norm_before_fc", False)),
        fc_norm=bool(cfg.get("fc_norm", False)),
        layout=layout.name,
        layout_note=layout.describe(),
        norm_before_residual=norm_before_residual,
        notes=notes,
    )


_REQUIRED = object()


def _size(config: dict[str, Any], key: str, where: str, default: Any = _REQUIRED) -> Any:
    """``config[key]`` as a positive int; ``default`` when absent or null (required if none)."""
    value = config.get(key)
    if value is None:
        if default is _REQUIRED:
            raise InitFromError(f"{where}: no {key}")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InitFromError(f"{where}: {key} {value!r} must be a positive integer")
    return value


@functools.lru_cache(maxsize=4)  # every export records it: hash a large draft once per run
def fingerprint_init_draft(path: str | Path) -> str:
    """The starting draft's identity in the new draft's lineage: config and weight bytes."""
    path = Path(path)
    return fingerprint_json(
        {
            "config.json": fingerprint_file(path / "config.json"),
            "model.safetensors": fingerprint_file(path / "model.safetensors"),
        }
    )


def compatibility_problems(
    init: InitDraft,
    arch: DraftArch,
    aux_layer_ids: list[int],
    d2t: np.ndarray,
    remap_vocab: bool,
    where: str,
) -> list[str]:
    """Why ``init`` cannot start a run of ``arch`` on a dataset of ``aux_layer_ids`` with the
    vocabulary map ``d2t`` (empty: it can). Each names both sides."""
    src = f"draft.init_from {init.path}"
    out = []
    for what, theirs, ours in (
        ("architecture", init.architecture, arch.architecture),
        ("hidden size", init.hidden_size, arch.hidden_size),
        ("target vocabulary size", init.target_vocab_size, arch.target_vocab_size),
        ("decoder layers", init.num_layers, arch.num_layers),
        ("norm_before_fc", init.norm_before_fc, arch.norm_before_fc),
        ("fc_norm", init.fc_norm, arch.fc_norm),
    ):
        if theirs != ours:
            out.append(f"{what}: {src} has {theirs}, this run ({where}) has {ours}")
    if (
        init.norm_before_residual is not None
        and init.norm_before_residual != arch.norm_before_residual
    ):
        out.append(
            f"norm_before_residual: {src} ({init.layout} layout) has {init.norm_before_residual}, "
            f"this run has {arch.norm_before_residual} (set draft.norm_before_residual: "
            f"{str(init.norm_before_residual).lower()})"
        )
    if init.aux_layer_ids is not None and init.aux_layer_ids != list(aux_layer_ids):
        out.append(
            f"aux layer ids: {src} was fed layers {init.aux_layer_ids}, the hidden-state "
            f"dataset ({where}) holds {list(aux_layer_ids)}"
        )
    same_vocab = len(init.d2t) == len(d2t) and np.array_equal(init.d2t, d2t)
    if not same_vocab and not remap_vocab:
        out.append(
            f"draft vocabulary: {src} has {len(init.d2t)} tokens with another d2t than this "
            f"run's vocabulary map ({len(d2t)} tokens, {where}); set draft.remap_vocab: true to "
            "carry over the LM-head rows of the tokens both hold"
        )
    return out


def load_into(model: torch.nn.Module, init: InitDraft, d2t: np.ndarray) -> dict[str, Any]:
    """Copy the starting draft's weights into ``model`` (shapes checked name by name); the LM
    head row by row through target ids when the vocabularies differ. Returns counts."""
    own = dict(model.named_parameters())
    weights = init.path / "model.safetensors"
    carried = 0
    loaded = []
    with safe_open(str(weights), "pt") as f, torch.no_grad():
        stored = init.vllm_names(list(f.keys()), str(weights))
        by_name = {ours: theirs for theirs, ours in stored.items()}
        names = [n for n in by_name if n not in ("d2t", "t2d", "embed_tokens.weight")]
        missing = sorted(n for n in own if n not in names and n != "lm_head.weight")
        missing = [n for n in missing if own[n].requires_grad]
        if missing:
            raise InitFromError(f"draft.init_from {weights}: no tensor for {missing[:8]}")
        for name in names:
            if name not in own:
                raise InitFromError(
                    f"draft.init_from {weights}: tensor {name!r} has no place in this draft"
                )
            tensor = f.get_tensor(by_name[name])
            if name == "lm_head.weight":
                continue
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise InitFromError(
                    f"draft.init_from {weights}: {name} is {list(tensor.shape)}, this draft's "
                    f"is {list(own[name].shape)}"
                )
            own[name].copy_(tensor.to(own[name].dtype))
            loaded.append(name)
        head = f.get_tensor("lm_head.weight") if "lm_head.weight" in names else None
    if head is not None:
        ours = np.arange(len(d2t), dtype=np.int64) + d2t
        row_of = {int(t): i for i, t in enumerate(init.target_ids)}
        lm = own["lm_head.weight"]
        with torch.no_grad():
            for i, target_id in enumerate(ours.tolist()):
                j = row_of.get(target_id)
                if j is not None:
                    lm[i].copy_(head[j].to(lm.dtype))
                    carried += 1
    return {
        "tensors": len(loaded) + (head is not None),
        "lm_head_rows_carried": carried,
        "lm_head_rows_from_target": len(d2t) - carried,
    }
