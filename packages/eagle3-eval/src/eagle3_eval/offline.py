"""Offline mode: simulated chain drafting on a held-out hidden-state dataset.

For every anchor row t of a sample (x_0..x_{T-1}) the draft proposes k tokens exactly as vLLM
would after the target verified x_0..x_{t+1}: step 0 from the target's aux states of rows
0..t and tokens x_1..x_{t+1}, step j from its own output and token x_{t+1+j} (see
``draft.chain_logits``). Draft token j is compared with the target's prediction at row
t+1+j (from ``last_hidden_state`` through the target's final norm and lm_head):

- temperature 0: accepted iff it equals the target's argmax; a draft's accepted count is
  the length of the matching prefix;
- temperature > 0 (greedy drafts, as vLLM): token j is accepted with probability
  p_T(d_j), drawn with a seeded generator so counts are integers; the analytic expectation
  ``1 + mean_t sum_i prod_{j<=i} p_T(d_j)`` is reported beside it.

Anchors are rows whose k draft inputs x_{t+1}..x_{t+k} are all assistant tokens
(``loss_mask``), i.e. positions where the served model would be generating.

What this is and is not: the chain is teacher-forced on the dataset's tokens. When the
dataset holds the target's own greedy outputs (eagle3-data regenerate at temperature 0) that
is exactly the path greedy decoding takes, and the result estimates vLLM's acceptance;
otherwise it measures agreement along the data path. Every row is an anchor here, while
vLLM drafts only after each verification — the per-draft averages are comparable, the
counts are not. Offline accuracy does not prove serving alignment (a misaligned draft can
look good here); the vllm mode does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import torch
from torch import Tensor

from eagle3_eval.acceptance import SampleCounts, summarize
from eagle3_eval.config import OfflineConfig
from eagle3_eval.draft import Eagle3Draft, chain_logits
from eagle3_eval.preflight import (
    DraftInfo,
    PreflightError,
    check_aux_ids,
    check_lineage,
    check_not_trained_on,
    inspect_draft,
)
from eagle3_eval.report import EvalResult, versions
from eagle3_schemas.contract.lineage import fingerprint_artifact
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.layouts.hidden_states import resolve_shard_path

# The one group of an offline report: the held-out dataset's samples.
OFFLINE_SET = "hidden_states"


@dataclass
class Sample:
    sample_id: str
    aux: Tensor  # [T, n_aux, H] float32
    last: Tensor  # [T, H] float32
    input_ids: Tensor  # [T] int64
    loss_mask: Tensor  # [T] bool


def _dequantize(f: Any, name: str, rows: slice) -> Tensor:
    tensor = f.get_slice(name)[rows]
    if tensor.dtype == torch.float8_e4m3fn:
        scale = f.get_slice(f"{name}_scale")[rows].float()
        return tensor.float() * scale.unsqueeze(-1)
    return tensor.float()


def read_samples(dataset: Path, limit: int | None) -> list[Sample]:
    """Samples in manifest order (a deterministic prefix when ``limit`` is set)."""
    from safetensors import safe_open

    manifest = pq.read_table(dataset / "manifest.parquet").to_pylist()
    if limit is not None:
        manifest = manifest[:limit]
    by_shard: dict[str, list[dict[str, Any]]] = {}
    for row in manifest:
        by_shard.setdefault(row["shard"], []).append(row)
    samples: dict[str, Sample] = {}
    for shard, rows in by_shard.items():
        with safe_open(str(resolve_shard_path(dataset, shard)), framework="pt") as f:
            for row in rows:
                span = slice(row["row_start"], row["row_start"] + row["num_tokens"])
                samples[row["sample_id"]] = Sample(
                    row["sample_id"],
                    _dequantize(f, "aux_hidden_states", span),
                    _dequantize(f, "last_hidden_state", span),
                    f.get_slice("input_ids")[span].long(),
                    f.get_slice("loss_mask")[span].bool(),
                )
    return [samples[row["sample_id"]] for row in manifest]


class TargetHead:
    """The target's final norm and lm_head, from the dataset's target_head.safetensors."""

    def __init__(self, tensors: dict[str, Tensor], eps: float) -> None:
        self.norm = tensors["norm.weight"].float()
        self.lm_head = tensors["lm_head.weight"].float()
        self.eps = eps

    def logits(self, last: Tensor) -> Tensor:
        x = last.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.norm * x) @ self.lm_head.T


def anchors(loss_mask: Tensor, k: int) -> Tensor:
    """Rows t with x_{t+1}..x_{t+k} all assistant tokens (so t + k <= T - 1)."""
    length = loss_mask.shape[0]
    if length <= k:
        return torch.zeros(0, dtype=torch.long)
    windows = loss_mask[1:].unfold(0, k, 1)  # row t: loss_mask[t+1 .. t+k]
    return torch.nonzero(windows.all(dim=1)).flatten()


def accepted_counts(matches: Tensor) -> Tensor:
    """matches [n, k] bool -> length of the leading run of True per row."""
    return matches.long().cumprod(dim=1).sum(dim=1)


def score(
    drafted: Tensor, target_logits: Tensor, temperature: float, generator: torch.Generator
) -> tuple[Tensor, float]:
    """drafted [n, k] target ids, target_logits [n, k, V] at the positions they are checked.

    Returns the accepted prefix length per draft [n] and the analytic expectation of its sum.
    Temperature 0: exact match with the target's argmax. Temperature > 0: token j is accepted
    with probability p_T(d_j) (rejection sampling of a greedy draft), drawn from ``generator``.
    """
    if temperature == 0:
        accepted = accepted_counts(drafted == target_logits.argmax(-1))
        return accepted, float(accepted.sum())
    p = torch.softmax(target_logits.float() / temperature, dim=-1)
    p_accept = p.gather(-1, drafted[..., None]).squeeze(-1)  # [n, k]
    matches = torch.rand(p_accept.shape, generator=generator) < p_accept
    return accepted_counts(matches), float(p_accept.cumprod(dim=1).sum())


@torch.inference_mode()
def simulate(
    draft: Eagle3Draft,
    head: TargetHead,
    sample: Sample,
    k: int,
    temperatures: tuple[float, ...],
    generators: list[torch.Generator],
) -> list[tuple[SampleCounts, float]]:
    """Per temperature: the sample's counts and the analytic expected accepted-token sum.

    The draft proposes greedily at every temperature (vLLM's default), so its chain is
    computed once and scored against the target at each temperature.
    """
    rows = anchors(sample.loss_mask, k)
    if rows.numel():
        steps = chain_logits(draft, sample.aux, sample.input_ids, k)
        drafted = torch.stack([draft.to_target_ids(s[rows].argmax(-1)) for s in steps], dim=1)
        # Target predictions at rows t+1+j for every anchor t and step j: [n, k, V].
        target_rows = rows[:, None] + 1 + torch.arange(k)[None, :]
        target_logits = head.logits(sample.last[target_rows])
    out = []
    for temperature, generator in zip(temperatures, generators, strict=True):
        counts = SampleCounts(sample.sample_id, k)
        counts.num_generated_tokens = int(sample.loss_mask.sum())
        counts.num_prompt_tokens = int((~sample.loss_mask).sum())
        counts.extra["prompt_set"] = OFFLINE_SET
        expected = 0.0
        if rows.numel():
            accepted, expected = score(drafted, target_logits, temperature, generator)
            for a in accepted.tolist():
                counts.observe(k, int(a))
        out.append((counts, expected))
    return out


def target_eps(config: OfflineConfig, draft: DraftInfo) -> tuple[float, str]:
    if config.target_rms_norm_eps is not None:
        return config.target_rms_norm_eps, "given"
    verifier = Path(draft.spec.verifier_path) / "config.json"
    if draft.spec.verifier_path and verifier.is_file():
        return float(json.loads(verifier.read_text())["rms_norm_eps"]), str(verifier)
    return draft.spec.rms_norm_eps, "the draft's rms_norm_eps (verifier config not found)"


def held_out_by(draft: DraftInfo, dataset_fingerprint: str) -> str:
    """What is known about these states being held out from the draft's training data.

    Only an eagle3-train draft names its training dataset (eagle3.json lineage); preflight has
    already refused the case where it is this very dataset. Anything else is unknown, and the
    report says so rather than claim the states were held out.
    """
    trained_on = (draft.lineage or {}).get("hidden_states_fingerprint")
    if not trained_on:
        why = "records no lineage" if draft.lineage is None else "lineage names no hidden states"
        return (
            f"UNVERIFIED: the draft {why}, so whether it was trained on these hidden states "
            "is unknown"
        )
    return (
        f"lineage: the draft was trained on hidden states {trained_on}, these are "
        f"{dataset_fingerprint} (datasets compared by fingerprint, samples not compared)"
    )


def run_offline(config: OfflineConfig) -> list[EvalResult]:
    """One result per temperature in ``config.temperatures``."""
    from safetensors.torch import load_file

    from eagle3_schemas.contract.header import read_header

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    dataset = config.hidden_states
    if not config.skip_validation:
        violations = validate(dataset)
        if violations:
            listing = "\n  ".join(str(v) for v in violations[:20])
            raise PreflightError(
                f"{dataset}: the hidden-state dataset does not validate:\n  {listing}"
            )
    header = read_header(dataset)
    if header.artifact != "hidden_states":
        raise PreflightError(f"{dataset}: is a {header.artifact!r} artifact, not hidden_states")
    info = inspect_draft(config.draft, strict=not config.ignore_lineage)
    check_aux_ids(info.spec, header.fields["aux_layer_ids"], f"the dataset {dataset}")
    target = header.fields["target"]
    if target["hidden_size"] != info.spec.target_hidden_size or (
        target["vocab_size"] != info.spec.target_vocab_size
    ):
        raise PreflightError(
            f"{dataset}: target hidden {target['hidden_size']} / vocab {target['vocab_size']}, "
            f"the draft expects {info.spec.target_hidden_size} / {info.spec.target_vocab_size}"
        )
    dataset_fp = fingerprint_artifact(dataset)
    check_not_trained_on(info, dataset_fp, dataset)
    lineage_notes = check_lineage(
        info,
        {"target_fingerprint": header.lineage["target_fingerprint"]},
        f"dataset {dataset}",
        config.ignore_lineage,
    )
    head_tensors = load_file(str(dataset / "target_head.safetensors"))
    eps, eps_from = target_eps(config, info)
    draft = Eagle3Draft.load(config.draft, head_tensors["embed_tokens.weight"])
    head = TargetHead(head_tensors, eps)
    temperatures = config.temperatures
    generators = [torch.Generator().manual_seed(config.seed) for _ in temperatures]
    per_temperature: list[list[SampleCounts]] = [[] for _ in temperatures]
    expected_totals = [0.0 for _ in temperatures]
    for sample in read_samples(dataset, config.max_samples):
        results = simulate(draft, head, sample, config.k, temperatures, generators)
        for i, (counts, expected) in enumerate(results):
            per_temperature[i].append(counts)
            expected_totals[i] += expected
    engine = {
        "name": "offline",
        "versions": versions("eagle3-eval", "torch", "transformers"),
        "device": "cpu",
        "dtype": "float32",
        "storage_dtype": header.fields["storage_dtype"],
    }
    lineage = {
        "draft_fingerprint": info.fingerprint,
        "target_fingerprint": header.lineage["target_fingerprint"],
        "prompts_fingerprint": dataset_fp,
    }
    held_out = held_out_by(info, dataset_fp)
    out = []
    for temperature, samples, expected_total in zip(
        temperatures, per_temperature, expected_totals, strict=True
    ):
        summary = summarize(samples, config.k)
        extra: dict[str, Any] = {
            "inputs": {"draft": str(config.draft), "hidden_states": str(dataset)},
            "prompts": {
                "path": str(dataset),
                "held_out_by": held_out,
                "num_prompts": len(samples),
                "fingerprint": dataset_fp,
            },
            "sampling": {
                "temperature": temperature,
                "seed": config.seed,
                "draft_proposal": "greedy",
                "anchors": "rows whose k draft inputs are all assistant tokens",
            },
            "expected_acceptance_length": (
                1 + expected_total / summary.num_drafts if summary.num_drafts else 1.0
            ),
            "target_rms_norm_eps": {"value": eps, "from": eps_from},
            "notes": info.notes + lineage_notes,
        }
        out.append(
            EvalResult(
                mode="offline",
                summary=summary,
                samples=samples,
                temperature=temperature,
                engine=engine,
                lineage=lineage,
                extra=extra,
            )
        )
    return out
