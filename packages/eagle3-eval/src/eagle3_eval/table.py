"""Several drafts, one table: a row per draft, a column per prompt set and category, and one
per kind of traffic (``kind:instant``, ``kind:thinking``, ``kind:agent``, those measured).

Written beside the drafts' own reports (``--out/<draft>/``) as ``table.md`` (what a model card
shows: acceptance length per benchmark, speedup beside it), ``table.json`` (the same cells, with
the per-position rates and each draft's path and fingerprint) and ``table.png``. Every cell is
read from a draft's report, so a draft's figures here are its report's. Reports that do not
share target, prompts, k and mode are refused: their cells would not be comparable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3_eval.groups import group_label
from eagle3_eval.plot import pyplot, save
from eagle3_eval.report import Report, ReportError
from eagle3_schemas.io.atomic import atomic_path, write_json_atomic

TABLE_MD, TABLE_JSON, TABLE_PNG = "table.md", "table.json", "table.png"
OVERALL = "all"
KIND_COLUMN = "kind:{}"  # a set's NAME holds no ':': no set's column is taken
SHARED = ("mode", "num_speculative_tokens")
SHARED_LINEAGE = ("target_fingerprint", "prompts_fingerprint")
FIELDS = (
    "num_prompts",
    "num_drafts",
    "acceptance_length",
    "acceptance_length_per_request",
    "per_position_acceptance",
    "speedup",
)


def cells(report: Report) -> dict[str, dict[str, Any]]:
    """Column -> figures: every prompt together (``all``), each set and category, each kind."""
    f = report.fields
    out = {OVERALL: {key: f.get(key) for key in FIELDS}}
    for group in report.groups:
        out[group_label(group)] = {key: group.get(key) for key in FIELDS}
    for kind in report.kinds:
        out[KIND_COLUMN.format(kind["kind"])] = {key: kind.get(key) for key in FIELDS}
    return out


def build_table(reports: dict[str, list[Report]]) -> dict[str, Any]:
    """``reports``: per draft name, its reports (one per temperature, same order for all)."""
    first = next(iter(reports.values()))[0].fields
    for name, per_temperature in reports.items():
        for report in per_temperature:
            f = report.fields
            differ = [k for k in SHARED if f[k] != first[k]]
            differ += [k for k in SHARED_LINEAGE if f["lineage"][k] != first["lineage"][k]]
            if differ:
                raise ReportError(
                    f"{report.path} ({name}): not comparable with the other drafts' reports: "
                    f"different {', '.join(differ)}"
                )
    rows = []
    columns: list[str] = []
    for name, per_temperature in reports.items():
        for report in per_temperature:
            figures = cells(report)
            columns += [c for c in figures if c not in columns]
            rows.append(
                {
                    "draft": name,
                    "draft_path": report.fields.get("inputs", {}).get("draft"),
                    "draft_fingerprint": report.fields["lineage"]["draft_fingerprint"],
                    "report": str(report.path),
                    "temperature": report.fields["temperature"],
                    "cells": figures,
                }
            )
    return {
        "mode": first["mode"],
        "engine": first["engine"].get("name"),
        "versions": first["engine"].get("versions", {}),
        "num_speculative_tokens": first["num_speculative_tokens"],
        "lineage": {k: first["lineage"][k] for k in SHARED_LINEAGE},
        "columns": columns,
        "rows": rows,
    }


def _cell(figures: dict[str, Any] | None) -> str:
    if not figures or figures.get("acceptance_length") is None:
        return "-"
    speedup = figures.get("speedup")
    per_request = figures.get("acceptance_length_per_request")
    text = f"{figures['acceptance_length']:.2f}"
    text += f" / {per_request:.2f}" if per_request is not None else " / -"
    return text + (f" ({speedup:.2f}x)" if speedup is not None else "")


def markdown(table: dict[str, Any]) -> str:
    engine = table["engine"]
    version = table["versions"].get(engine)
    lines = []
    for temperature in sorted({r["temperature"] for r in table["rows"]}):
        lines += [
            "Acceptance length, pooled (vLLM's: 1 + accepted / drafts over all drafts) / "
            "per-request mean (SpecForge's bench) (speedup) · "
            f"{table['mode']} ({engine}"
            + (f" {version}" if version else "")
            + f") · k={table['num_speculative_tokens']} · temperature {temperature:g}",
            "",
            "| draft | " + " | ".join(table["columns"]) + " |",
            "|---|" + "---|" * len(table["columns"]),
        ]
        for row in table["rows"]:
            if row["temperature"] != temperature:
                continue
            values = [_cell(row["cells"].get(c)) for c in table["columns"]]
            lines.append(f"| {row['draft']} | " + " | ".join(values) + " |")
        lines.append("")
    return "\n".join(lines)


def render_png(table: dict[str, Any], out: Path) -> Path:
    """Bars per column, one colour per draft: acceptance length above, speedup below."""
    plt = pyplot()
    temperatures = sorted({r["temperature"] for r in table["rows"]})
    columns = table["columns"]
    fig, axes = plt.subplots(
        2,
        len(temperatures),
        figsize=(max(6.0, 1.2 * len(columns)) * len(temperatures), 6.5),
        dpi=100,
        squeeze=False,
    )
    for j, temperature in enumerate(temperatures):
        rows = [r for r in table["rows"] if r["temperature"] == temperature]
        width = 0.8 / max(len(rows), 1)
        for i, row in enumerate(rows):
            xs = [c + (i - (len(rows) - 1) / 2) * width for c in range(len(columns))]
            for ax, key in ((axes[0][j], "acceptance_length"), (axes[1][j], "speedup")):
                values = [(row["cells"].get(c) or {}).get(key) or 0.0 for c in columns]
                ax.bar(xs, values, width=width, label=row["draft"])
        for ax, title in ((axes[0][j], "acceptance length"), (axes[1][j], "speedup")):
            ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right", fontsize=8)
            ax.set_title(f"{title} · temperature {temperature:g}", fontsize=9)
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(f"{table['mode']} · k={table['num_speculative_tokens']}", fontsize=10)
    fig.tight_layout()
    return save(plt, fig, out)


def write_table(reports: dict[str, list[Report]], out: Path, figure: bool = True) -> dict[str, Any]:
    """table.json, table.md and (``figure``, with matplotlib) table.png in ``out``."""
    table = build_table(reports)
    write_json_atomic(out / TABLE_JSON, table)
    with atomic_path(out / TABLE_MD) as tmp:
        tmp.write_text(markdown(table), encoding="utf-8")
    if figure:
        render_png(table, out / TABLE_PNG)
    return table
