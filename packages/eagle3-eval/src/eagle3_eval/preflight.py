"""Verify before run: the draft, the target and the data belong together, in seconds.

A draft is evaluated against the target it was trained for, on data it was not trained on;
anything else produces a number that looks fine and means nothing. Mismatches are errors that
name both sides; ``ignore_lineage`` downgrades them to notes recorded in the report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open

from eagle3_eval.draft_spec import CONFIG_FILE, LINEAGE_FILE, WEIGHTS_FILE, DraftSpec, read_spec
from eagle3_schemas.contract.lineage import fingerprint_files, lineage_mismatches
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.layouts.draft_vocab import serving_problems
from eagle3_schemas.layouts.target_config import text_config


class PreflightError(ValueError):
    """The inputs do not belong together."""


def check_cuda_driver() -> list[str]:
    """On a host with an NVIDIA driver: refuse one too old for the CUDA release torch was
    built for (torch would report no GPU); a note otherwise. Nothing on a machine without."""
    from eagle3_schemas.runtime.cuda_driver import check_this_host

    verdict = check_this_host()
    if verdict is None:
        return []
    level, message = verdict
    if level == "error":
        raise PreflightError(f"cuda_driver: {message}")
    return [f"cuda_driver: {message}"]


@dataclass
class DraftInfo:
    path: Path
    spec: DraftSpec
    fingerprint: str
    lineage: dict[str, Any] | None  # eagle3.json lineage, None for a foreign checkpoint
    notes: list[str] = field(default_factory=list)
    # Why vLLM would refuse or misread its vocabulary map (eagle3_schemas.layouts.draft_vocab): read
    # here all the same (a note), refused before an engine starts.
    unserved: list[str] = field(default_factory=list)


def inspect_draft(path: str | Path, strict: bool = True) -> DraftInfo:
    """Read and check a draft checkpoint; validate it fully when it is this project's artifact."""
    path = Path(path)
    spec = read_spec(path)
    if not (path / WEIGHTS_FILE).is_file():
        raise PreflightError(f"{path}: no {WEIGHTS_FILE}")
    # Every reader names the layout and the aux-id counting it found (eagle3_schemas.layouts.draft_layout).
    notes = [f"{path}: {spec.layout_note}", *spec.vllm_notes]
    with safe_open(str(path / WEIGHTS_FILE), "pt") as weights:
        names = {n.removeprefix("model.") for n in weights.keys()}  # noqa: SIM118
    unserved = [
        f"{path / WEIGHTS_FILE}: tensor {name}: {why}"
        for name, why in serving_problems(names, spec.draft_vocab_size, spec.target_vocab_size)
    ]
    notes += unserved
    lineage = None
    if (path / LINEAGE_FILE).is_file():
        violations = validate(path)
        if violations:
            listing = "\n  ".join(str(v) for v in violations[:20])
            message = f"{path}: the draft checkpoint does not validate:\n  {listing}"
            if strict:
                raise PreflightError(message)
            notes.append(message)
        lineage = json.loads((path / LINEAGE_FILE).read_text(encoding="utf-8")).get("lineage")
    else:
        notes.append(
            f"{path}: no {LINEAGE_FILE}; a foreign checkpoint, evaluated without lineage checks"
        )
    # Same definition as eagle3_schemas.contract.lineage.fingerprint_artifact for a draft checkpoint,
    # computable for foreign checkpoints (no eagle3.json) too.
    fingerprint = fingerprint_files([path / CONFIG_FILE, path / WEIGHTS_FILE], path)
    return DraftInfo(path, spec, fingerprint, lineage, notes, unserved)


def check_served_by_vllm(draft: DraftInfo) -> None:
    """Refuse, before an engine starts, a draft whose tensors vLLM would not load or would
    misread; eval's own loops read it (with the note)."""
    if draft.unserved:
        raise PreflightError(
            f"{draft.path}: vLLM would not serve this draft:\n  " + "\n  ".join(draft.unserved)
        )


def check_lineage(
    draft: DraftInfo,
    expected: dict[str, Any],
    expected_from: str,
    ignore: bool,
) -> list[str]:
    """Compare the draft's recorded lineage with what the inputs say; raise unless ignored."""
    if draft.lineage is None:
        return []
    problems = lineage_mismatches(expected, draft.lineage, expected_from, f"draft {draft.path}")
    if problems and not ignore:
        raise PreflightError(
            "the draft was not made for these inputs:\n  "
            + "\n  ".join(problems)
            + "\n(--ignore-lineage evaluates anyway and records this in the report)"
        )
    return problems


def check_not_trained_on(draft: DraftInfo, dataset_fingerprint: str, dataset: Path) -> None:
    if draft.lineage and draft.lineage.get("hidden_states_fingerprint") == dataset_fingerprint:
        raise PreflightError(
            f"{dataset} is the hidden-state dataset the draft {draft.path} was trained on "
            f"({dataset_fingerprint}); evaluate on held-out data"
        )


def check_aux_ids(spec: DraftSpec, layer_ids: list[int], where: str) -> None:
    if list(spec.aux_layer_ids) != list(layer_ids):
        raise PreflightError(
            f"aux layer ids differ: the draft reads {list(spec.aux_layer_ids)}, {where} has "
            f"{list(layer_ids)} (vLLM convention: id k = residual stream after k layers)"
        )


def check_target_shape(spec: DraftSpec, config: dict[str, Any], where: str) -> None:
    problems = []
    config = text_config(config)  # a wrapper's (Kimi-K2.5's) sizes sit under text_config
    hidden = config.get("hidden_size")
    if hidden is not None and int(hidden) != spec.target_hidden_size:
        problems.append(
            f"hidden_size {hidden} vs the draft's target_hidden_size {spec.target_hidden_size}"
        )
    vocab = config.get("vocab_size")
    if vocab is not None and int(vocab) != spec.target_vocab_size:
        problems.append(f"vocab_size {vocab} vs the draft's {spec.target_vocab_size}")
    layers = config.get("num_hidden_layers")
    if layers is not None and max(spec.aux_layer_ids) > int(layers):
        problems.append(f"{layers} layers, but the draft reads aux id {max(spec.aux_layer_ids)}")
    if problems:
        raise PreflightError(f"{where} does not fit the draft: " + "; ".join(problems))
