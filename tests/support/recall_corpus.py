"""The recall target's corpus: a fixed sample of the tiny corpus's short functions (code) and the
standard library's module docstrings (prose), split by file for the draft.

The target (tools/targets/build_tiny_recall_target.py) trains on every conversation, held-out
ones included, tens of epochs over: it knows them all by heart. The split is the draft's: its
recipe (recipes/tiny-recall) trains the draft on the "train" files and measures it on the
others, where the target recites what the draft never saw. Standard library only.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

from support.tiny_corpus import Conversation, build_corpus, stdlib_files, stdlib_root

HELDOUT_PERCENT = 12  # files whose conversations the draft never trains on (by path hash)
CODE_PERCENT = 17  # share of the short functions kept (by answer hash): what 1.7M weights learn
MAX_CODE_CHARS = 600
DOC_CHARS = (120, 900)  # module docstrings kept: long enough to say something, short to learn


def _bucket(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 100


def split_of(relpath: str) -> str:
    """The draft's split of a whole file, by the hash of its path (not the tiny corpus's)."""
    return "heldout" if _bucket("recall:" + relpath) < HELDOUT_PERCENT else "train"


def module_conversations(root: Path) -> list[Conversation]:
    """Every standard-library module whose docstring is DOC_CHARS long, as a question on it."""
    out = []
    for relpath in stdlib_files(root):
        try:
            tree = ast.parse((root / relpath).read_text(encoding="utf-8", errors="replace"))
        except SyntaxError:
            continue
        doc = (ast.get_docstring(tree) or "").strip()
        if not DOC_CHARS[0] <= len(doc) <= DOC_CHARS[1]:
            continue
        name = relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        prompt = f"What does the Python module `{name}` provide?"
        out.append(Conversation(relpath, name, 1, split_of(relpath), prompt, doc + "\n"))
    return out


def build_recall_corpus() -> list[Conversation]:
    """Short functions (a fixed sample) and module docstrings, deduplicated by answer, by file."""
    functions = [
        Conversation(c.source, c.name, c.lineno, split_of(c.source), c.prompt, c.answer)
        for c in build_corpus()
        if len(c.answer) <= MAX_CODE_CHARS and _bucket(c.answer) < CODE_PERCENT
    ]
    seen = {c.answer for c in functions}
    modules = [c for c in module_conversations(stdlib_root()) if c.answer not in seen]
    return sorted(functions + modules, key=lambda c: (c.source, c.lineno, c.name))
