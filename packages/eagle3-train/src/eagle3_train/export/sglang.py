"""The draft in the SpecForge / SGLang layout (``export.format: sglang | both``): what
SGLang's ``LlamaForCausalLMEagle3`` (``python/sglang/srt/models/llama_eagle3.py``) loads.

Written from a finished speculators export (``write.py``) into its own directory
(``OUTPUT/draft-sglang``): a flat Llama ``config.json`` naming ``LlamaForCausalLMEagle3`` with
``draft_vocab_size``, ``target_hidden_size`` and the aux ids under
``eagle_config.eagle_aux_hidden_state_layer_ids`` in SGLang's counting (vLLM's id - 1:
eagle3_schemas.layouts.draft_layout states the rule); the same ids in vLLM's counting at the top level,
which vLLM reads first and SGLang does not read, so ``vllm serve`` of this folder works too;
weights with layer 0 as ``midlayer.*``, ``d2t`` and ``t2d`` as they are (a full-vocabulary
draft has neither: eagle3_schemas.layouts.draft_vocab; SGLang then needs no ``hot_token_id``).

SGLang silently skips a tensor name it does not know, so every tensor written is checked
against the names its ``load_weights`` maps (``draft_layout.sglang_loads``, read from its
source): one it would skip is an error. SGLang's draft has no ``norm_before_fc`` /
``fc_norm`` / ``norm_output``, always keeps layer 0's residual un-normed
(``norm_before_residual: false``), reads exactly three aux states and one layer (its
additional layers compute differently from vLLM's); a draft that differs is refused, naming
the setting.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from eagle3_schemas.contract.header import write_safetensors
from eagle3_schemas.io.atomic import atomic_directory, write_json_atomic
from eagle3_schemas.layouts.draft_layout import (
    SGLANG_COUNTING,
    VLLM_COUNTING,
    sglang_loads,
    vllm_to_sglang_ids,
    vllm_to_sglang_name,
)
from eagle3_schemas.layouts.model_card import CARD_FILE, write_card
from eagle3_train.config.run_config import Config
from eagle3_train.export.card import render_card
from eagle3_train.model.arch import NORM_OPTIONS

SGLANG_DIR = "draft-sglang"
EXPORT_NOTE = "export.json"  # what this folder was made from (layout, source, lineage)


class SGLangExportError(ValueError):
    """The draft cannot be written in SGLang's layout."""


def sglang_problems(
    architecture: str,
    num_layers: int,
    aux_layer_ids: list[int] | None,
    norms: Mapping[str, bool],
) -> list[str]:
    """Why a draft of these settings (``norms``: each of NORM_OPTIONS) cannot be served by
    SGLang's LlamaForCausalLMEagle3."""
    out = []
    if architecture != "llama":
        out.append(
            f"draft.architecture {architecture!r}: the SGLang export writes SGLang's Llama-style "
            "LlamaForCausalLMEagle3 only"
        )
    if num_layers != 1:
        out.append(
            f"draft.num_layers {num_layers}: SGLang's additional draft layers drop the residual "
            "where vLLM's (and this trainer's) keep it; SGLang serves one-layer drafts as trained"
        )
    if norms["norm_before_residual"]:
        out.append(
            "draft.norm_before_residual true: SGLang's layer 0 always keeps the un-normed residual; "
            "train with draft.norm_before_residual: false for an SGLang export"
        )
    for name in NORM_OPTIONS[1:]:
        if norms[name]:
            out.append(f"draft.{name} true: SGLang's EAGLE-3 draft has no {name}")
    if aux_layer_ids is not None:
        if len(aux_layer_ids) != 3:
            out.append(f"aux layer ids {aux_layer_ids}: SGLang sizes fc for exactly 3 aux states")
        if min(aux_layer_ids, default=1) < 1:
            out.append(
                f"aux layer ids {aux_layer_ids} in {VLLM_COUNTING} include 0, which has no id in "
                f"{SGLANG_COUNTING}"
            )
    return out


def sglang_config(speculators: dict[str, Any]) -> dict[str, Any]:
    """SGLang's config.json from our speculators config.json."""
    layer = speculators["transformer_layer_config"]
    vllm_ids = list(speculators["eagle_aux_hidden_state_layer_ids"])
    return {
        **{k: v for k, v in layer.items() if k != "architectures"},
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "draft_vocab_size": speculators["draft_vocab_size"],
        "target_hidden_size": speculators["target_hidden_size"],
        "eagle_config": {
            # SGLang's counting (the target captures before layer id + 1).
            "eagle_aux_hidden_state_layer_ids": vllm_to_sglang_ids(vllm_ids),
            "use_aux_hidden_state": True,
        },
        # vLLM's counting; vLLM reads this key first, SGLang reads only eagle_config.
        "eagle_aux_hidden_state_layer_ids": vllm_ids,
        "norm_before_residual": False,
    }


def sglang_launch_command(target: str, draft: str, k: int) -> str:
    return (
        f"python -m sglang.launch_server --model-path {target} \\\n"
        f"  --speculative-algorithm EAGLE3 --speculative-draft-model-path {draft} \\\n"
        f"  --speculative-num-steps {k} --speculative-eagle-topk 1 "
        f"--speculative-num-draft-tokens {k + 1}"
    )


def write_sglang_export(
    source: Path, directory: Path, config: Config | None = None, served_as: str | None = None
) -> Path:
    """Write ``directory`` (must not exist) from the speculators export ``source``: config,
    renamed weights, a note of the source and its lineage, and (with ``config``) a model card
    giving ``sglang.launch_server`` beside ``vllm serve``."""
    source, directory = Path(source), Path(directory)
    speculators = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if speculators.get("speculators_model_type") != "eagle3":
        raise SGLangExportError(
            f"{source / 'config.json'}: the SGLang export is written from a speculators eagle3 "
            "export (a Llama-style draft)"
        )
    layer = speculators["transformer_layer_config"]
    ids = list(speculators["eagle_aux_hidden_state_layer_ids"])
    norms = {k: bool(speculators.get(k, k == "norm_before_residual")) for k in NORM_OPTIONS}
    problems = sglang_problems("llama", int(layer.get("num_hidden_layers", 1)), ids, norms)
    if problems:
        raise SGLangExportError(
            f"{source}: cannot be written for SGLang:\n  " + "\n  ".join(problems)
        )
    weights = {
        vllm_to_sglang_name(n): t for n, t in load_file(str(source / "model.safetensors")).items()
    }
    skipped = sorted(n for n in weights if sglang_loads(n) is None and n != "t2d")
    if skipped:
        raise SGLangExportError(
            f"{source}: SGLang's loader would skip {skipped} silently (not among the names its "
            "load_weights maps)"
        )
    header = json.loads((source / "eagle3.json").read_text(encoding="utf-8"))
    with atomic_directory(directory) as tmp:
        write_safetensors(tmp / "model.safetensors", weights)
        write_json_atomic(tmp / "config.json", sglang_config(speculators))
        write_json_atomic(
            tmp / EXPORT_NOTE,
            {
                "layout": "sglang",
                "written_from": {"layout": "speculators", "path": str(source)},
                "aux_layer_ids": header.get("aux_layer_ids"),
                "lineage": header.get("lineage"),
            },
        )
        if config is not None:
            k = config.export.speculative_tokens
            target = config.target.name_or_path or config.target.path or "TARGET"
            draft = served_as or str(directory)
            card = render_card(source, config, draft)
            sglang = (
                "## Serve\n\nSGLang (this folder is in the SpecForge / SGLang layout):\n\n"
                f"```bash\n{sglang_launch_command(target, draft, k)}\n```\n\nvLLM (reads this "
                "folder too: the top-level aux ids are in its counting):\n\n"
            )
            write_card(tmp / CARD_FILE, card.replace("## Serve\n\n", sglang, 1))
    return directory
