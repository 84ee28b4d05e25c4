"""No module of a package over 500 lines unless its opening docstring says why (with the words
"on purpose"): a long module is usually two concerns, and a reader should not have to guess."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500


def test_long_modules_state_their_reason() -> None:
    found = []
    for path in sorted(ROOT.glob("packages/*/src/**/*.py")):
        text = path.read_text(encoding="utf-8")
        if text.count("\n") <= LIMIT:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if "on purpose" not in docstring:
            found.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines, no reason given")
    assert not found, "split these, or say in the docstring why not:\n" + "\n".join(found)
