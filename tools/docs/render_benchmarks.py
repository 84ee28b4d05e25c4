"""Render the benchmark tables and plots of docs/benchmarks/ and the README's results summary
from the result files kept beside the pages (docs/benchmarks/*.json).

    uv run --frozen python tools/docs/render_benchmarks.py           # rewrite tables and plots
    uv run --frozen python tools/docs/render_benchmarks.py --check   # exit 1 when a table is stale

A result file states once at its top the question, the command that measured it, the date and
the versions; then its tables. A table of kind ``arms`` lists drafts with their acceptance
length per seed (or, for runs whose seeds were not kept, a mean and range); means, ranges and
ratios are computed here, never typed. A page holds each table between
``<!-- table:FILE/ID -->`` and ``<!-- /table -->``, and its header between ``<!-- header:FILE -->``
and ``<!-- /header -->``; this tool rewrites what lies between. A test of the quick tier
(tests/test_docs.py) fails when a page or the README differs from what this renders.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "docs" / "benchmarks"
README = ROOT / "README.md"

# The README's one results summary: (label of the target, result file, row id), at most 6.
SUMMARY: list[tuple[str, str, str]] = [
    ("tiny Llama", "vs-speculators", "speculators-defaults-150"),
    ("tiny Llama", "vs-speculators", "ours-defaults-150"),
    ("tiny Llama", "vs-speculators", "speculators-tuned-600"),
    ("tiny Llama", "vs-speculators", "ours-defaults-600"),
    ("tiny MLA + MoE", "vs-speculators", "mla-speculators-tuned-600"),
    ("tiny MLA + MoE", "vs-speculators", "mla-ours-defaults-600"),
]
BLOCK = re.compile(r"(<!-- (table|header):([\w./-]+) -->\n)(.*?)(<!-- /\2 -->)", re.S)
SUMMARY_BLOCK = re.compile(r"(<!-- summary -->\n)(.*?)(<!-- /summary -->)", re.S)


def f3(value: float) -> str:
    return f"{value:.3f}"


@dataclass(frozen=True)
class Arm:
    """A draft's acceptance length: per seed, or a mean and range where the seeds were not kept."""

    row: dict[str, Any]

    @property
    def seeds(self) -> dict[str, float]:
        return dict(sorted(self.row.get("seeds", {}).items()))

    @property
    def mean(self) -> float:
        return fmean(self.seeds.values()) if self.seeds else self.row["summary"]["mean"]

    @property
    def low(self) -> float:
        return min(self.seeds.values()) if self.seeds else self.row["summary"]["min"]

    @property
    def high(self) -> float:
        return max(self.seeds.values()) if self.seeds else self.row["summary"]["max"]

    def al(self) -> str:
        """'mean (min..max)' over several seeds, the one figure for one seed."""
        if len(self.seeds) == 1:
            return f3(self.mean)
        return f"{f3(self.mean)} ({f3(self.low)}..{f3(self.high)})"

    def per_seed(self) -> str:
        if not self.seeds:
            return f"seeds {self.row['summary']['seeds']}"
        if len(self.seeds) == 1:
            return f"seed {next(iter(self.seeds))}"
        return " / ".join(f3(v) for v in self.seeds.values())

    def per_position(self) -> str:
        return " / ".join(f3(p) for p in self.row.get("per_position", []))


def load(name: str) -> dict[str, Any]:
    return json.loads((BENCH / f"{name}.json").read_text(encoding="utf-8"))


def table_of(name: str, table_id: str) -> dict[str, Any]:
    for table in load(name)["tables"]:
        if table["id"] == table_id:
            return table
    raise KeyError(f"{name}.json has no table {table_id!r}")


def arm_of(name: str, row_id: str) -> Arm:
    for table in load(name)["tables"]:
        for row in table["rows"]:
            if isinstance(row, dict) and row.get("id") == row_id:
                return Arm(row)
    raise KeyError(f"{name}.json has no row {row_id!r}")


def _bold(text: str, on: bool) -> str:
    return f"**{text}**" if on and text else text


def render_arms(name: str, table: dict[str, Any]) -> str:
    rows = table["rows"]
    evaluator = any("evaluator" in r for r in rows)
    positions = any("per_position" in r for r in rows)
    steps = table.get("columns", {}).get("steps", "steps")
    heads = ["draft", *(["evaluator"] if evaluator else []), steps, "AL mean (min..max)"]
    heads += ["per seed (0 / 1 / 2)", *(["per position (mean)"] if positions else [])]
    reference_of = {r["id"]: r.get("reference", table.get("reference")) for r in rows}
    ratio = any(reference_of.values())
    if ratio:
        heads.append("× reference")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for row in rows:
        arm, default = Arm(row), bool(row.get("default"))
        cells = [row["arm"]]
        cells += [row["evaluator"]] if evaluator else []
        cells += [str(row["steps"]), _bold(arm.al(), default), arm.per_seed()]
        cells += [arm.per_position()] if positions else []
        if ratio:
            reference = reference_of[row["id"]]
            shown = f3(arm.mean / arm_of(name, reference).mean) if reference else ""
            cells.append(_bold(shown, default))
        lines.append("| " + " | ".join(cells) + " |")
    if any(r.get("default") for r in rows):
        lines += ["", "Bold: the recipe's defaults."]
    if ratio:
        references = [r for r in dict.fromkeys(reference_of.values()) if r]
        named = "; ".join(
            f"{_row(rows, r)['arm']}, " + _at(steps, _row(rows, r)["steps"]) for r in references
        )
        lines += ["", f"× reference: a row's mean over the mean of the reference row ({named})."]
    return "\n".join(lines) + "\n"


def _at(label: str, value: Any) -> str:
    return f"{value} steps" if label == "steps" else f"{label} = {value}"


def _row(rows: list[dict[str, Any]], row_id: str) -> dict[str, Any]:
    return next(r for r in rows if r.get("id") == row_id)


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        arm = Arm(value)
        if len(arm.seeds) == 1:
            return f3(arm.mean)
        return f"{arm.per_seed()} ({f3(arm.mean)})"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def render_grid(table: dict[str, Any]) -> str:
    lines = ["| " + " | ".join(table["columns"]) + " |", "|" + "---|" * len(table["columns"])]
    for row in table["rows"]:
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines) + "\n"


def render_throughput(table: dict[str, Any]) -> str:
    heads = ["draft shape", "ours tokens/s (MFU)", "speculators tokens/s (MFU)", "speed"]
    heads.append("peak GiB, ours / speculators")
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for r in table["rows"]:
        # the ratios the check reported, where the file keeps them
        speed = r.get("speed", r["ours_tokens_s"] / r["speculators_tokens_s"])
        peak = r.get("peak_ratio", r["ours_peak_gib"] / r["speculators_peak_gib"])
        cells = [
            r["shape"],
            f"{r['ours_tokens_s']:,} ({r['ours_mfu']:.2f})",
            f"{r['speculators_tokens_s']:,} ({r['speculators_mfu']:.2f})",
            _bold(f"{speed:.2f}×", speed > 1),
            f"{r['ours_peak_gib']:.2f} / {r['speculators_peak_gib']:.2f} ({peak:.2f}×)",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_table(name: str, table_id: str) -> str:
    table = table_of(name, table_id)
    body = {
        "arms": lambda: render_arms(name, table),
        "grid": lambda: render_grid(table),
        "throughput": lambda: render_throughput(table),
    }[table["kind"]]()
    when = f" Measured {table['measured']}." if "measured" in table else ""
    return f"*{table['title']}.*{when}\n\n{body}"


def render_header(name: str) -> str:
    data = load(name)
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    lines = [
        f"- Command: `{data['command']}`",
        f"- Measured: {data['measured']}, on {data['hardware']}",
        f"- Versions: {versions}",
    ]
    if "settings" in data:
        lines.append(f"- Settings: {data['settings']}")
    lines.append(f"- Result file: [{name}.json]({name}.json) (tables rendered from it)")
    return "\n".join(lines) + "\n"


def render_summary() -> str:
    heads = ["target", "draft", "steps", "AL, mean (min..max)", "per seed (0 / 1 / 2)"]
    lines = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    for target, name, row_id in SUMMARY:
        arm = arm_of(name, row_id)
        cells = [target, arm.row["arm"], str(arm.row["steps"]), arm.al(), arm.per_seed()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def rendered(text: str) -> str:
    """``text`` (a page or the README) with its generated blocks rendered anew."""

    def block(m: re.Match[str]) -> str:
        kind, ref = m.group(2), m.group(3)  # header:FILE or table:FILE/ID
        body = render_header(ref) if kind == "header" else render_table(*ref.split("/"))
        return m.group(1) + body + m.group(5)

    text = BLOCK.sub(block, text)
    return SUMMARY_BLOCK.sub(lambda m: m.group(1) + render_summary() + m.group(3), text)


def pages() -> Iterator[Path]:
    yield README
    yield from sorted(BENCH.glob("*.md"))


def plot() -> list[Path]:
    """The per-position acceptance of the summary's drafts and the lr sweeps, as PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, target in zip(axes, ("tiny Llama", "tiny MLA + MoE"), strict=True):
        for label, name, row_id in SUMMARY:
            arm = arm_of(name, row_id)
            if label != target or arm.row["steps"] != 600:
                continue
            positions = arm.row["per_position"]
            name_shown = arm.row["arm"].replace("`", "")
            ax.plot(range(1, len(positions) + 1), positions, marker="o", label=name_shown)
        ax.set_title(f"{target}, 600 steps, k = 3 (vLLM, greedy)", fontsize=9)
        ax.set_xlabel("draft position")
        ax.set_xticks([1, 2, 3])
        ax.legend(fontsize=7)
    written.append(_save(fig, axes, "acceptance rate (mean of seeds)", "per-position.png"))

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, table_id, title in (
        (axes[0], "muon-lr", "Muon, 150 steps"),
        (axes[1], "adamw-lr", "AdamW on every tensor, 150 steps, seed 0"),
    ):
        table = table_of("lr-width", table_id)
        for row in table["rows"]:
            points = [
                (lr, Arm(c))
                for lr, c in zip(table["lrs"], row[1:], strict=True)
                if isinstance(c, dict)
            ]
            lrs = [lr for lr, _ in points]
            ax.errorbar(
                lrs,
                [a.mean for _, a in points],
                yerr=[[a.mean - a.low for _, a in points], [a.high - a.mean for _, a in points]],
                marker="o",
                capsize=3,
                label=f"hidden {row[0]}",
            )
        ax.set_xscale("log")
        ax.set_xticks(table["lrs"], [f"{lr:g}" for lr in table["lrs"]])
        ax.minorticks_off()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("learning rate")
        ax.legend(fontsize=8)
    written.append(_save(fig, axes, "vLLM AL, mean (min..max of seeds)", "lr-width.png"))
    return written


def _save(fig, axes, ylabel: str, name: str) -> Path:
    """A figure of two panels, the left one's y label, written under docs/benchmarks/ (no
    software stamp, so the file changes only with the figure)."""
    import matplotlib.pyplot as plt

    axes[0].set_ylabel(ylabel)
    fig.tight_layout()
    fig.savefig(BENCH / name, dpi=110, metadata={"Software": None})
    plt.close(fig)
    return BENCH / name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a page is stale")
    args = parser.parse_args(argv)
    stale = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        new = rendered(text)
        if new != text:
            stale.append(page)
            if not args.check:
                page.write_text(new, encoding="utf-8")
                print(f"wrote {page.relative_to(ROOT)}")
    if args.check:
        for page in stale:
            print(f"{page.relative_to(ROOT)} is stale: run tools/docs/render_benchmarks.py")
        return 1 if stale else 0
    for path in plot():
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
