"""verify: prove a hidden-state dataset holds the right tensors.

1. The dataset validates against its schema (structure, per-row checksums, finiteness).
2. Lineage: the target directory and tokenized input given are the ones it was made from.
3. Token ids and loss masks agree, row for row, with the tokenized input.
4. N samples are recomputed with the transformers reference backend (float32) and compared per
   layer id. The error of a row is ``max|stored - ref| / max|ref|`` over the hidden dimension
   (the per-row bound storage rounding obeys); a layer fails when its worst row exceeds the
   tolerance: storage rounding bound + compute-dtype allowance. A capture one layer off, or id N
   taken after the final norm, is off by O(1) in that measure and fails.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from eagle3_extract.backends.hf import HFBackend
from eagle3_extract.config import MODEL_EXPECTED
from eagle3_extract.reader import DatasetReader
from eagle3_extract.samples import Sample, read_tokenized
from eagle3_extract.storage import STORAGE_RELATIVE_ERROR
from eagle3_schemas.contract.header import read_header
from eagle3_schemas.contract.lineage import fingerprint_artifact, fingerprint_model_dir
from eagle3_schemas.contract.paths import check_input_artifact, check_input_dir
from eagle3_schemas.contract.validate import validate

log = logging.getLogger(__name__)

# Allowance for the dataset's compute dtype against the float32 reference. float32: different
# kernels and summation orders (measured ~1e-7 relative). bf16/fp16 compute rounds every layer's
# activations and weights' products (measured ~1e-2 of a row's max on the tiny targets).
COMPUTE_RELATIVE_ERROR = {"float32": 1e-4, "bfloat16": 3e-2, "float16": 1e-2}


@dataclass
class LayerError:
    layer_id: int
    role: str  # "aux" | "last (pre-norm)"
    max_abs: float
    max_rel: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_rel <= self.tolerance


@dataclass
class VerifyReport:
    dataset: str
    problems: list[str] = field(default_factory=list)
    layers: list[LayerError] = field(default_factory=list)
    samples_recomputed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(layer.ok for layer in self.layers)

    def to_json(self) -> dict[str, Any]:
        return {
            "dataset": self.dataset,
            "ok": self.ok,
            "problems": self.problems,
            "samples_recomputed": self.samples_recomputed,
            "layers": [{**asdict(x), "ok": x.ok} for x in self.layers],
        }

    def render(self) -> str:
        lines = [f"verify {self.dataset}: {'PASS' if self.ok else 'FAIL'}"]
        lines += [f"  problem: {p}" for p in self.problems]
        if self.layers:
            lines.append(
                f"  recomputed {len(self.samples_recomputed)} samples with transformers (float32)"
            )
            lines.append("  layer id  role             max abs err   max rel err   tolerance  ok")
            for x in self.layers:
                lines.append(
                    f"  {x.layer_id:8d}  {x.role:15s}  {x.max_abs:11.3e}   {x.max_rel:11.3e}   "
                    f"{x.tolerance:9.3e}  {'yes' if x.ok else 'NO'}"
                )
        return "\n".join(lines)


def default_tolerance(storage_dtype: str, compute_dtype: str) -> float:
    return STORAGE_RELATIVE_ERROR[storage_dtype] + COMPUTE_RELATIVE_ERROR.get(compute_dtype, 3e-2)


def row_errors(stored: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer: max abs error, and max over rows of (row's max abs error / row's max |ref|)."""
    diff = (stored - ref).abs()  # [T, n, H]
    scale = ref.abs().amax(dim=-1).clamp_min(1e-30)  # [T, n]
    return diff.amax(dim=(0, 2)), (diff.amax(dim=-1) / scale).amax(dim=0)


def check_tokens(reader: DatasetReader, tokenized_path: Path) -> list[str]:
    tokenized = {s.sample_id: s for s in read_tokenized(tokenized_path).samples}
    problems = []
    for row, sample_id in enumerate(reader.manifest["sample_id"]):
        source = tokenized.get(sample_id)
        if source is None:
            problems.append(f"manifest row {row}: sample {sample_id!r} is not in {tokenized_path}")
            continue
        ids, mask = reader.tokens(row)
        if not np.array_equal(ids, source.input_ids):
            first = int(np.argmax(ids != source.input_ids)) if len(ids) == source.num_tokens else -1
            problems.append(
                f"manifest row {row}: sample {sample_id!r}: stored input_ids differ from the "
                f"tokenized input ({len(ids)} vs {source.num_tokens} tokens, first difference at "
                f"position {first})"
            )
        elif not np.array_equal(mask, source.loss_mask):
            problems.append(f"manifest row {row}: sample {sample_id!r}: stored loss_mask differs")
        if len(problems) >= 20:
            problems.append("... (stopped after 20)")
            break
    return problems


def pick_rows(total: int, count: int, seed: int) -> list[int]:
    if count >= total:
        return list(range(total))
    return sorted(np.random.default_rng(seed).choice(total, size=count, replace=False).tolist())


def verify(
    dataset: Path,
    model: Path,
    tokenized: Path | None = None,
    *,
    num_samples: int = 8,
    tolerance: float | None = None,
    seed: int = 0,
    batch_tokens: int = 8192,
) -> VerifyReport:
    check_input_artifact(dataset, "hidden_states", "dataset")
    check_input_dir(model, "--model", MODEL_EXPECTED, must_contain=("config.json",))
    if tokenized is not None:
        check_input_artifact(tokenized, "tokenized", "--tokenized")
    report = VerifyReport(str(dataset))
    violations = validate(dataset)
    if violations:
        report.problems += [f"schema: {v}" for v in violations[:20]]
        return report  # the rest reads the dataset and assumes it sound
    header = read_header(dataset)
    fields = header.fields
    model_fp = fingerprint_model_dir(model)
    if header.lineage["target_fingerprint"] != model_fp:
        report.problems.append(
            f"lineage target_fingerprint: {dataset} was made from {header.lineage['target_fingerprint']}"
            f" but {model} is {model_fp}"
        )
    reader = DatasetReader(dataset)
    if tokenized is not None:
        tok_fp = fingerprint_artifact(tokenized)
        if header.lineage["tokenized_fingerprint"] != tok_fp:
            report.problems.append(
                f"lineage tokenized_fingerprint: {dataset} was made from "
                f"{header.lineage['tokenized_fingerprint']} but {tokenized} is {tok_fp}"
            )
        report.problems += check_tokens(reader, tokenized)
    if report.problems:
        return report

    aux = list(fields["aux_layer_ids"])
    n_layers = fields["target"]["num_hidden_layers"]
    layer_ids = [*aux, n_layers]
    tol = (
        tolerance
        if tolerance is not None
        else default_tolerance(fields["storage_dtype"], fields.get("compute_dtype", "bfloat16"))
    )
    rows = pick_rows(len(reader), num_samples, seed)
    stored = [reader.sample(r) for r in rows]
    samples = [
        Sample(r, s.sample_id, s.input_ids, s.loss_mask) for r, s in zip(rows, stored, strict=True)
    ]
    backend = HFBackend(model, layer_ids, dtype="float32", batch_tokens=batch_tokens)
    refs = backend.capture(samples)
    max_abs = torch.zeros(len(layer_ids))
    max_rel = torch.zeros(len(layer_ids))
    for s, ref in zip(stored, refs, strict=True):
        a, r = row_errors(s.states, ref.states)
        max_abs, max_rel = torch.maximum(max_abs, a), torch.maximum(max_rel, r)
    report.samples_recomputed = [s.sample_id for s in stored]
    for i, layer_id in enumerate(layer_ids):
        report.layers.append(
            LayerError(
                layer_id,
                "aux" if i < len(aux) else "last (pre-norm)",
                float(max_abs[i]),
                float(max_rel[i]),
                tol,
            )
        )
    return report
