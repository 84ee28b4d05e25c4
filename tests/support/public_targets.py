"""Stand-ins of public targets for the recipe planner: each fixture holds the facts of one
published model (its config.json as on the hub, its tokenizer's EOS and a chat template with the
published template's markers: thinking, tools) and becomes a model directory without weights."""

from __future__ import annotations

import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "public_targets"
PLANNED = sorted(p.stem for p in FIXTURES.glob("*.json") if not p.stem.startswith("gemma"))
REFUSED = ["gemma-2-9b-it"]


def facts(name: str) -> dict[str, dict]:
    return json.loads((FIXTURES / f"{name}.json").read_text(encoding="utf-8"))


def model_dir(name: str, root: Path) -> Path:
    """``root/name`` holding config.json, tokenizer_config.json and generation_config.json."""
    f = facts(name)
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(f["config"]), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(
        json.dumps(f["tokenizer_config"]), encoding="utf-8"
    )
    if f["generation_config"]:
        (folder / "generation_config.json").write_text(
            json.dumps(f["generation_config"]), encoding="utf-8"
        )
    return folder
