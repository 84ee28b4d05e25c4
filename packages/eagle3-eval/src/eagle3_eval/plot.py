"""acceptance.png: per-position acceptance, acceptance-length distribution, speedup, and the
acceptance length and speedup of each prompt set and category.

Rendered from the report directory itself (report.json + samples.parquet), so a report can be
re-rendered later with ``eagle3-eval report DIR --figure``. matplotlib is the ``plot`` extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from eagle3_eval.groups import group_label
from eagle3_schemas.io.atomic import atomic_path

WIDTH_INCHES, HEIGHT_INCHES, DPI = 18.0, 4.0, 100


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never a display
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable("matplotlib is missing (install the 'plot' extra)") from e
    return plt


def save(plt: Any, fig: Any, out: Path) -> Path:
    """Write ``fig`` to ``out`` as a PNG, whole or not at all, and free it."""
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return out


def render(report_dir: str | Path, out: str | Path | None = None) -> Path:
    plt = pyplot()
    report_dir = Path(report_dir)
    out = Path(out) if out is not None else report_dir / "acceptance.png"
    f = json.loads((report_dir / "report.json").read_text(encoding="utf-8"))
    samples = pq.read_table(report_dir / "samples.parquet")
    k = f["num_speculative_tokens"]
    engine = f["engine"].get("name", "?")
    versions = f["engine"].get("versions", {})
    if engine in versions:
        engine = f"{engine} {versions[engine]}"
    title = (
        f"{f['mode']} mode ({engine}) · k={k} · T={f['temperature']} · "
        f"{f['num_prompts']} prompts · acceptance length {f['acceptance_length']:.2f}"
    )
    fig, axes = plt.subplots(1, 4, figsize=(WIDTH_INCHES, HEIGHT_INCHES), dpi=DPI)
    fig.suptitle(title, fontsize=10)

    # 1. Per-position acceptance (vLLM's definition) and the conditional rate beside it.
    ax = axes[0]
    positions = list(range(k))
    rates = f["per_position_acceptance"]
    conditional = [c if c is not None else 0.0 for c in f.get("conditional_acceptance") or []]
    ax.bar([p - 0.2 for p in positions], rates, width=0.4, label="accepted / drafts")
    if conditional:
        ax.bar([p + 0.2 for p in positions], conditional, width=0.4, label="conditional")
    ax.set_xticks(positions, [str(p + 1) for p in positions])
    ax.set_xlabel("draft position")
    ax.set_ylim(0, 1)
    ax.set_title("per-position acceptance", fontsize=9)
    ax.legend(fontsize=8)

    # 2. Tokens per verification step (accepted + 1), over all drafts; per-prompt means as ticks.
    ax = axes[1]
    histogram = f.get("accepted_histogram") or []
    drafts = max(f["num_drafts"], 1)
    ax.bar([j + 1 for j in range(len(histogram))], [c / drafts for c in histogram])
    per_prompt = [v for v in samples.column("acceptance_length").to_pylist() if v is not None]
    if per_prompt:
        ax.plot(
            per_prompt,
            [0.0] * len(per_prompt),
            "|",
            color="black",
            markersize=12,
            label="per-prompt mean",
        )
        ax.legend(fontsize=8)
    ax.axvline(f["acceptance_length"], color="red", linestyle="--", linewidth=1)
    ax.set_xlabel("tokens per step (accepted + 1)")
    ax.set_ylabel("share of drafts")
    ax.set_title("acceptance-length distribution", fontsize=9)

    # 3. Throughput with and without the draft.
    ax = axes[2]
    tps, base = f.get("tokens_per_second"), f.get("baseline_tokens_per_second")
    if tps is not None:
        labels, values = ["with draft"], [tps]
        if base is not None:
            labels.insert(0, "target alone")
            values.insert(0, base)
        ax.bar(labels, values, color=["gray", "tab:green"][-len(values) :])
        speedup = f.get("speedup")
        ax.set_title(f"speedup {speedup:.2f}x" if speedup is not None else "tokens/s", fontsize=9)
        ax.set_ylabel("generated tokens / s")
    else:
        ax.text(0.5, 0.5, "no throughput\n(offline mode)", ha="center", va="center")
        ax.set_axis_off()

    # 4. Per prompt set and category: acceptance length, speedup printed on the bar.
    ax = axes[3]
    groups = f.get("groups") or []
    labels = [group_label(g) for g in groups]
    ax.bar(range(len(groups)), [g["acceptance_length"] for g in groups], color="tab:blue")
    for x, g in enumerate(groups):
        speedup = g.get("speedup")
        note = f"{g['acceptance_length']:.2f}" + (f"\n{speedup:.2f}x" if speedup else "")
        ax.text(x, g["acceptance_length"], note, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(groups)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylim(1, k + 1)
    ax.set_ylabel("acceptance length")
    ax.set_title("per prompt set / category", fontsize=9)
    fig.tight_layout()
    return save(plt, fig, out)
