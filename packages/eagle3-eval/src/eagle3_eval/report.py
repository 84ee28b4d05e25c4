"""The eval-report artifact: report.json + samples.parquet (+ acceptance.png), and its views.

Written atomically into a directory that appears only once the artifact validates against
``schemas/eval_report`` (v2: figures per prompt set and category); an invalid report is never
published. v1 reports (no groups) are read as one group, their whole prompt set. Online reports
also give ``kinds``: the same figures per kind of traffic (instant, thinking, agent), each
sample's kind in samples.parquet's ``kind`` column (an addition v2's header and columns allow).
"""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from eagle3_eval.acceptance import SampleCounts, Summary
from eagle3_eval.groups import FIGURES, TimedKey, group_figures, group_label, kind_figures
from eagle3_schemas.contract.header import make_header, write_json_header, write_parquet
from eagle3_schemas.contract.validate import validate
from eagle3_schemas.io.atomic import atomic_directory
from eagle3_schemas.layouts.model_card import ACCEPTANCE_DEFINITIONS

REPORT_FILE = "report.json"
SAMPLES_FILE = "samples.parquet"


class ReportError(ValueError):
    """A report cannot be written or read."""


@dataclass
class Baseline:
    """The same prompts decoded without the draft: per-sample tokens and seconds."""

    tokens_per_second: float
    per_sample: dict[str, tuple[int, float | None, list[int] | None]] = field(default_factory=dict)
    group_seconds: dict[TimedKey, float] = field(default_factory=dict)


@dataclass
class EvalResult:
    mode: str  # offline | vllm | reference
    summary: Summary
    samples: list[SampleCounts]
    temperature: float
    engine: dict[str, Any]
    lineage: dict[str, str]  # draft_fingerprint, target_fingerprint, prompts_fingerprint
    tokens_per_second: float | None = None
    baseline: Baseline | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # prompts, sampling, inputs, checks
    group_seconds: dict[TimedKey, float] = field(default_factory=dict)  # generation time

    @property
    def speedup(self) -> float | None:
        if self.tokens_per_second is None or self.baseline is None:
            return None
        if not self.baseline.tokens_per_second:
            return None
        return self.tokens_per_second / self.baseline.tokens_per_second


def versions(*packages: str) -> dict[str, str]:
    """Installed versions of ``packages`` (those present), plus Python's."""
    out = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def _samples_table(result: EvalResult) -> pa.Table:
    rows = result.samples

    def col(values: list[Any], kind: pa.DataType) -> pa.Array:
        return pa.array(values, type=kind)

    columns: dict[str, pa.Array] = {
        "sample_id": col([s.sample_id for s in rows], pa.string()),
        "num_drafts": col([s.num_drafts for s in rows], pa.int64()),
        "num_accepted_tokens": col([s.num_accepted_tokens for s in rows], pa.int64()),
        "num_generated_tokens": col([s.num_generated_tokens for s in rows], pa.int64()),
        "num_draft_tokens": col([s.num_draft_tokens for s in rows], pa.int64()),
        "accepted_per_position": col(
            [list(s.accepted_per_position) for s in rows], pa.list_(pa.int64())
        ),
        "acceptance_length": col([s.acceptance_length for s in rows], pa.float64()),
        "num_prompt_tokens": col([s.num_prompt_tokens for s in rows], pa.int64()),
        "seconds": col([s.seconds for s in rows], pa.float64()),
        "source": col([str(s.extra.get("source", "")) for s in rows], pa.string()),
        "prompt_set": col([str(s.extra["prompt_set"]) for s in rows], pa.string()),
        "category": col([s.extra.get("category") for s in rows], pa.string()),
        # 1 for a first prompt; 2 for MT-Bench's second turn, asked after the target's answer.
        "turn": col([int(s.extra.get("turn", 1)) for s in rows], pa.int64()),
        # instant, thinking or agent (prompt_files.KINDS); null offline, where there are no prompts.
        "kind": col([s.extra.get("kind") for s in rows], pa.string()),
        # The generated tokens themselves: two reports can be compared prompt by prompt.
        "output_token_ids": col([s.output_token_ids for s in rows], pa.list_(pa.int32())),
    }
    if result.baseline is not None:
        base = result.baseline.per_sample
        columns["baseline_num_generated_tokens"] = col(
            [base[s.sample_id][0] if s.sample_id in base else None for s in rows], pa.int64()
        )
        columns["baseline_seconds"] = col(
            [base[s.sample_id][1] if s.sample_id in base else None for s in rows], pa.float64()
        )
        if result.temperature == 0:
            # Greedy speculative decoding is lossless: the output should equal the target's
            # own greedy output (rare float ties aside). Recorded per sample, not assumed.
            same = []
            for s in rows:
                other = base.get(s.sample_id, (0, None, None))[2]
                same.append(
                    None
                    if other is None or s.output_token_ids is None
                    else s.output_token_ids == other
                )
            columns["same_output_as_baseline"] = col(same, pa.bool_())
    return pa.table(columns)


def header_fields(result: EvalResult) -> dict[str, Any]:
    s = result.summary
    timing = (
        result.group_seconds,
        {k: v[0] for k, v in result.baseline.per_sample.items()} if result.baseline else None,
        result.baseline.group_seconds if result.baseline else None,
    )
    fields: dict[str, Any] = {
        "mode": result.mode,
        **s.fields(),
        # what each acceptance-length figure means (report fields and every group alike)
        "acceptance_length_definitions": dict(ACCEPTANCE_DEFINITIONS),
        "temperature": result.temperature,
        "engine": result.engine,
        "tokens_per_second": result.tokens_per_second,
        "baseline_tokens_per_second": (
            result.baseline.tokens_per_second if result.baseline is not None else None
        ),
        "speedup": result.speedup,
        "groups": group_figures(result.samples, s.num_speculative_tokens, timing),
        **result.extra,
    }
    kinds = kind_figures(result.samples, s.num_speculative_tokens, timing)
    if kinds:
        fields["kinds"] = kinds
    if result.baseline is not None and result.temperature == 0:
        table = _samples_table(result)
        same = [v for v in table.column("same_output_as_baseline").to_pylist() if v is not None]
        fields["outputs_identical_to_baseline"] = {"identical": sum(same), "compared": len(same)}
    return fields


def write_report(result: EvalResult, out: str | Path, figure: bool = True) -> Path:
    """Write the report directory ``out`` (must not exist); returns it. Validates first."""
    out = Path(out)
    with atomic_directory(out) as tmp:
        write_parquet(tmp / SAMPLES_FILE, _samples_table(result))
        header = make_header("eval_report", result.lineage, **header_fields(result))
        write_json_header(tmp / REPORT_FILE, header)
        if figure:
            from eagle3_eval.plot import PlotUnavailable, render

            try:
                render(tmp)
            except PlotUnavailable as e:
                # The figure is optional in the schema; say why it is missing, in the report.
                header.fields["figure"] = f"not rendered: {e}"
                write_json_header(tmp / REPORT_FILE, header)
        violations = validate(tmp)
        if violations:
            listing = "\n  ".join(str(v) for v in violations)
            raise ReportError(f"refusing to publish an invalid report at {out}:\n  {listing}")
    return out


@dataclass(frozen=True)
class Report:
    path: Path
    fields: dict[str, Any]
    samples: pa.Table

    @property
    def kinds(self) -> list[dict[str, Any]]:
        """Figures per kind of traffic; none in offline reports and reports written before."""
        return list(self.fields.get("kinds") or [])

    @property
    def groups(self) -> list[dict[str, Any]]:
        """Figures per set and category; a v1 report is one group, its whole prompt set."""
        if "groups" in self.fields:
            return list(self.fields["groups"])
        whole = {name: self.fields.get(name) for name in FIGURES}
        speed = ("tokens_per_second", "baseline_tokens_per_second", "speedup")
        return [
            {"prompt_set": "prompts", "category": None, **whole}
            | {name: self.fields.get(name) for name in speed}
        ]


def read_report(path: str | Path) -> Report:
    path = Path(path)
    report_file = path / REPORT_FILE
    if not report_file.is_file():
        raise ReportError(f"{path}: no {REPORT_FILE}; not an eval report directory")
    fields = json.loads(report_file.read_text(encoding="utf-8"))
    if fields.get("artifact") != "eval_report":
        raise ReportError(f"{report_file}: artifact is {fields.get('artifact')!r}")
    return Report(path, fields, pq.read_table(path / SAMPLES_FILE))


# ---- terminal views -------------------------------------------------------------------------


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _engine(fields: dict[str, Any]) -> str:
    engine = fields.get("engine", {})
    vers = engine.get("versions", {})
    shown = ", ".join(f"{k} {v}" for k, v in vers.items() if k != "python")
    return f"{engine.get('name', '?')} ({shown})" if shown else str(engine.get("name", "?"))


def format_table(report: Report) -> str:
    f = report.fields
    k = f["num_speculative_tokens"]
    histogram = f.get("accepted_histogram") or []
    drafts = f["num_drafts"] or 1
    lines = [
        f"{report.path}: {f['mode']}  k={k}  temperature={f['temperature']}  "
        f"prompts={f['num_prompts']}",
        f"  engine               {_engine(f)}",
        f"  acceptance length    {f['acceptance_length']:.3f}   "
        f"(1 + {f['num_accepted_tokens']} accepted / {f['num_drafts']} drafts) pooled, vLLM's",
        f"  per-request mean     {_num(f.get('acceptance_length_per_request'))}   "
        "(each prompt's 1 + accepted / drafts, averaged; SpecForge's bench)",
        "  per position         " + "  ".join(_num(x) for x in f["per_position_acceptance"]),
        "  conditional          "
        + "  ".join(_num(x) for x in f.get("conditional_acceptance") or []),
        "  accepted per draft   "
        + "  ".join(f"{j}:{100 * c / drafts:.0f}%" for j, c in enumerate(histogram)),
        f"  tokens/s             {_num(f.get('tokens_per_second'), 1)}   baseline "
        f"{_num(f.get('baseline_tokens_per_second'), 1)}   speedup {_num(f.get('speedup'), 2)}",
    ]
    same = f.get("outputs_identical_to_baseline")
    if same:
        lines.append(f"  greedy outputs equal to baseline: {same['identical']}/{same['compared']}")
    for title, rows, label in (
        ("per set / category ", report.groups if len(report.groups) > 1 else [], group_label),
        ("per kind of traffic", report.kinds, lambda g: g["kind"]),
    ):
        if rows:
            lines.append(f"  {title}  prompts  drafts  AL      per position         speedup")
        for g in rows:
            positions = " ".join(_num(x, 2) for x in g["per_position_acceptance"])
            lines.append(
                f"    {label(g):<19}{g['num_prompts']:>7}{g['num_drafts']:>8}  "
                f"{g['acceptance_length']:.3f}   {positions:<20} {_num(g.get('speedup'), 2)}"
            )
    prompts = f.get("prompts")
    if isinstance(prompts, dict):
        lines.append(f"  prompts              {prompts.get('held_out_by', '?')}")
    lines += [f"  WARNING: {w}" for w in f.get("warnings") or []]
    return "\n".join(lines)


MEASURES = {
    "offline": "the draft's k-token chains scored against the target's stored distributions "
    "along the held-out dataset's tokens (teacher-forced, no generation)",
    "vllm": "real speculative decoding in vLLM: the target generates from the prompts, vLLM "
    "counts accepted draft tokens",
    "reference": "real speculative decoding in the transformers loop, vLLM's schedule and "
    "counting: the target generates from the prompts",
}
OFFLINE_VS_ONLINE = (
    "offline estimates the online figure only where the dataset's tokens are what the target "
    "generates: held-out states extracted from the target's own answers (regenerated, greedy, "
    "as the training set) at temperature 0. It differs when the dataset holds other text (the "
    "corpus answers as written: the draft is then scored on tokens the target would not "
    "produce), at temperature > 0, or when the prompts differ. The trainer's "
    "val/accept_len_proxy is the same estimate at training time."
)


def compare_table(a: Report, b: Report) -> str:
    """Two reports side by side, with B - A, and warnings where they are not comparable."""
    fa, fb = a.fields, b.fields
    rows: list[tuple[str, Any, Any, bool]] = [
        ("mode", fa["mode"], fb["mode"], False),
        ("engine", _engine(fa), _engine(fb), False),
        ("k", fa["num_speculative_tokens"], fb["num_speculative_tokens"], False),
        ("temperature", fa["temperature"], fb["temperature"], False),
        ("prompts", fa["num_prompts"], fb["num_prompts"], True),
        ("drafts", fa["num_drafts"], fb["num_drafts"], True),
        ("acceptance length", fa["acceptance_length"], fb["acceptance_length"], True),
        (
            "  per-request mean",
            fa.get("acceptance_length_per_request"),
            fb.get("acceptance_length_per_request"),
            True,
        ),
    ]
    k = max(fa["num_speculative_tokens"], fb["num_speculative_tokens"])
    for i in range(k):
        pa_, pb_ = fa["per_position_acceptance"], fb["per_position_acceptance"]
        rows.append(
            (
                f"  position {i}",
                pa_[i] if i < len(pa_) else None,
                pb_[i] if i < len(pb_) else None,
                True,
            )
        )
    for key, label in (
        ("tokens_per_second", "tokens/s"),
        ("baseline_tokens_per_second", "baseline tokens/s"),
        ("speedup", "speedup"),
    ):
        rows.append((label, fa.get(key), fb.get(key), True))
    width = max(len(str(r[0])) for r in rows) + 2
    col = max(len(_num(v)) for r in rows for v in r[1:3]) + 2
    lines = [f"A = {a.path}", f"B = {b.path}", f"{'':{width}}{'A':<{col}}{'B':<{col}}B - A"]
    for label, x, y, numeric in rows:
        delta = ""
        if numeric and isinstance(x, int | float) and isinstance(y, int | float):
            delta = _num(y - x) if isinstance(x, float) or isinstance(y, float) else str(y - x)
        lines.append(f"{label:<{width}}{_num(x):<{col}}{_num(y):<{col}}{delta}")
    warnings = []
    for key in ("target_fingerprint", "prompts_fingerprint", "draft_fingerprint"):
        if fa["lineage"].get(key) != fb["lineage"].get(key):
            warnings.append(f"different {key.removesuffix('_fingerprint')}")
    if warnings:
        lines.append("note: " + "; ".join(warnings))
    lines += [
        f"{name} = {fields['mode']}: {MEASURES[fields['mode']]}"
        for name, fields in (("A", fa), ("B", fb))
    ]
    if "offline" in (fa["mode"], fb["mode"]) and fa["mode"] != fb["mode"]:
        lines.append(OFFLINE_VS_ONLINE)
    return "\n".join(lines)
