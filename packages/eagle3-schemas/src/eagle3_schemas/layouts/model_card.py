"""The draft's model card (``README.md`` beside ``config.json``): what the Hub and a reader see.

Two stages write it and must not import each other, so the card's shape lives here:
eagle3-train renders the card at export (front matter, architecture, data, training, the
``vllm serve`` command); eagle3-eval puts its measured acceptance table into it, one table per
measurement setting, replacing an earlier table of the same setting.

The front matter is YAML a Hub parser reads (``huggingface_hub.ModelCard``); it is written by
hand here (strings as JSON-quoted scalars, which YAML reads as they are) so the contract library
needs no YAML dependency. Each acceptance table sits between two HTML comments, the opening one
carrying its setting as JSON: invisible on the Hub, and the key that decides what is replaced.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from eagle3_schemas.io.atomic import atomic_path

CARD_FILE = "README.md"
# Where eval's tables go: eagle3-train writes this line at the end of the Acceptance section.
TABLES_ANCHOR = "<!-- eagle3-eval acceptance tables end -->"
_BEGIN = "<!-- eagle3-eval acceptance "
_END = "<!-- /eagle3-eval acceptance -->"
_BLOCK = re.compile(re.escape(_BEGIN) + r"(\{.*?\}) -->\n.*?" + re.escape(_END) + r"\n?", re.S)


# The two acceptance-length definitions in use (vllm-project/vllm#42508): every report, table and card
# gives both, each named, so a figure is compared with a published one of the same definition.
AL_POOLED = "acceptance_length"
AL_PER_REQUEST = "acceptance_length_per_request"
ACCEPTANCE_DEFINITIONS = {
    AL_POOLED: "pooled over all drafts: 1 + accepted tokens / drafts, every request's counts "
    "summed first (vLLM's spec-decode metrics; the headline figure)",
    AL_PER_REQUEST: "per-request mean: each request's 1 + accepted / drafts, averaged over the "
    "requests with at least one draft (SpecForge's bench)",
}


class CardError(ValueError):
    """A model card cannot be read or updated."""


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return json.dumps(value)
    return json.dumps(str(value))  # a JSON string is a valid YAML double-quoted scalar


def front_matter(fields: dict[str, Any]) -> str:
    """``---`` YAML ``---`` of scalars and lists of scalars; None values and empty lists left out."""
    lines = ["---"]
    for key, value in fields.items():
        if value is None or value == []:
            continue
        if isinstance(value, list | tuple):
            lines.append(f"{key}:")
            lines.extend(f"- {_scalar(v)}" for v in value)
        elif isinstance(value, dict):
            raise CardError(f"front matter {key}: nested mappings are not written here")
        else:
            lines.append(f"{key}: {_scalar(value)}")
    lines.append("---")
    return "\n".join(lines) + "\n"


def serve_command(
    target: str,
    draft: str,
    num_speculative_tokens: int,
    extra_args: tuple[str, ...] = (),
) -> str:
    """The ``vllm serve`` line that serves ``target`` with ``draft`` as its EAGLE-3 draft."""
    spec = json.dumps(
        {"method": "eagle3", "model": draft, "num_speculative_tokens": num_speculative_tokens},
        separators=(",", ":"),
    )
    words = ["vllm", "serve", target, *extra_args, "--speculative-config", spec]
    return " ".join(shlex.quote(w) for w in words)


# ---- acceptance tables (eagle3-eval) ---------------------------------------------------------


def acceptance_setting(report: dict[str, Any]) -> dict[str, Any]:
    """What makes two measurements comparable (the key a newer table replaces an older by):
    mode, engine and its release, k, temperature, the prompt set, generated length."""
    engine = report.get("engine", {})
    name = engine.get("name", "?")
    return {
        "mode": report["mode"],
        "engine": name,
        "version": engine.get("versions", {}).get(name),
        "k": report["num_speculative_tokens"],
        "temperature": report["temperature"],
        "prompts": report.get("prompts", {}).get("fingerprint"),
        "max_new_tokens": report.get("sampling", {}).get("max_new_tokens"),
    }


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.4f}"


def acceptance_table(report: dict[str, Any]) -> str:
    """Markdown: a heading naming the setting, then acceptance length, per-position rates,
    drafts, prompts and speedup — the numbers of ``report`` (an eval report's report.json)."""
    s = acceptance_setting(report)
    k = s["k"]
    engine = f"{s['engine']} {s['version']}" if s["version"] else s["engine"]
    decoding = "greedy" if not s["temperature"] else f"sampled, temperature {s['temperature']:g}"
    prompts = report["num_prompts"]
    heading = f"#### {engine}, k = {k}, {decoding}, {prompts} prompts ({report['mode']} mode)"
    per_position = report["per_position_acceptance"]
    head = ["acceptance length (pooled, vLLM)", *[f"position {i + 1}" for i in range(k)]]
    head += ["drafts", "prompts", "speedup", "acceptance length (per-request mean, SpecForge)"]
    row = [_num(report["acceptance_length"]), *[_num(p) for p in per_position]]
    speedup = report.get("speedup")
    row += [str(report["num_drafts"]), str(prompts), "-" if speedup is None else f"{speedup:.2f}x"]
    row += [_num(report.get(AL_PER_REQUEST))]
    lines = [
        heading,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
        "| " + " | ".join(row) + " |",
        "",
        f"Prompt set `{s['prompts']}`, up to {s['max_new_tokens']} new tokens each. "
        f"Acceptance length, pooled: {ACCEPTANCE_DEFINITIONS[AL_POOLED]}; per-request mean: "
        f"{ACCEPTANCE_DEFINITIONS[AL_PER_REQUEST]}.",
    ]
    return "\n".join(lines)


def put_acceptance(card: str, report: dict[str, Any]) -> str:
    """``card`` with the table of ``report``: in place of a table of the same setting, else
    before the tables anchor (else at the end)."""
    setting = acceptance_setting(report)
    key = json.dumps(setting, sort_keys=True, separators=(",", ":"))
    block = f"{_BEGIN}{key} -->\n{acceptance_table(report)}\n{_END}\n"
    for match in _BLOCK.finditer(card):
        if json.loads(match.group(1)) == setting:
            return card[: match.start()] + block + card[match.end() :]
    return _insert(card, block)


def _insert(card: str, block: str) -> str:
    if TABLES_ANCHOR in card:
        return card.replace(TABLES_ANCHOR, block + "\n" + TABLES_ANCHOR, 1)
    return card.rstrip("\n") + "\n\n" + block


def carry_tables(old_card: str, new_card: str) -> str:
    """``new_card`` with the acceptance tables of ``old_card`` whose setting it lacks (a card
    rendered again keeps what eval measured)."""
    present = [json.loads(m.group(1)) for m in _BLOCK.finditer(new_card)]
    for match in _BLOCK.finditer(old_card):
        if json.loads(match.group(1)) not in present:
            new_card = _insert(new_card, match.group(0).rstrip("\n") + "\n")
    return new_card


def update_card(draft_dir: str | Path, report: dict[str, Any]) -> Path | None:
    """Put ``report``'s table into ``draft_dir/README.md`` (atomically); None when the draft
    has no card (an export older than cards, or another tool's draft)."""
    path = Path(draft_dir) / CARD_FILE
    if not path.is_file():
        return None
    text = put_acceptance(path.read_text(encoding="utf-8"), report)
    write_card(path, text)
    return path


def write_card(path: str | Path, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)
