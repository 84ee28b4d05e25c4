"""The tiny targets' corpus: functions of the Python standard library as chat conversations.

    user:      Write a Python function `name(args)` that does this: <docstring's first line>.
    assistant: <the function's source code>

Split by source file into train and held-out (by path hash), deduplicated by answer. The
builders of the embedded targets train on it (tools/targets/build_tiny_target.py,
build_tiny_mla_target.py; ``--corpus-only`` writes it for recipes/tiny/pipeline.sh), and the
tests read it to score the shipped targets on held-out answers. Standard library only.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sysconfig
import textwrap
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

HELDOUT_PERCENT = 5  # share of standard-library *files* held out (split by path hash)
MAX_FUNCTION_CHARS = 1500  # longer functions are left out, so samples stay short
SKIPPED_DIRS = frozenset(
    # Test suites are absent from many Python distributions; third-party code is not stdlib.
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
)


@dataclass(frozen=True)
class Conversation:
    """One standard-library function as a user request and the assistant's answer."""

    source: str  # path relative to the stdlib root, POSIX separators
    name: str  # qualified name inside the file, e.g. "Class.method"
    lineno: int
    split: str  # "train" or "heldout"
    prompt: str
    answer: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "user", "content": self.prompt},
            {"role": "assistant", "content": self.answer},
        ]

    def to_json(self) -> dict[str, object]:
        return {
            "messages": self.messages,
            "source": self.source,
            "split": self.split,
            "name": self.name,
            "lineno": self.lineno,
        }


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path) -> list[str]:
    """Relative POSIX paths of the standard library's Python files, sorted."""
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if not SKIPPED_DIRS.intersection(rel.parts):
            files.append(rel.as_posix())
    return sorted(files)


def split_of(relpath: str) -> str:
    """Split a whole file into train or held-out by the hash of its path (stable everywhere)."""
    bucket = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    args = ast.unparse(node.args)
    return f"{node.name}({args})"


def _request(node: ast.FunctionDef | ast.AsyncFunctionDef, owner: str | None, doc: str) -> str:
    summary = doc.strip().splitlines()[0].strip().rstrip(".")
    summary = summary[:1].lower() + summary[1:]
    kind = "async function" if isinstance(node, ast.AsyncFunctionDef) else "function"
    if owner is None:
        return f"Write a Python {kind} `{_signature(node)}` that does this: {summary}."
    return f"Write the method `{_signature(node)}` of class `{owner}` that does this: {summary}."


def _functions(
    tree: ast.AST, prefix: str = "", owner: str | None = None
) -> Iterator[tuple[str, str | None, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, enclosing class, node) of every function, methods included, in order."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield prefix + node.name, owner, node
            yield from _functions(node, f"{prefix}{node.name}.", None)
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.", node.name)
        else:
            yield from _functions(node, prefix, owner)


def conversations_of_file(root: Path, relpath: str) -> list[Conversation]:
    source = (root / relpath).read_text(encoding="utf-8", errors="replace")
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    split = split_of(relpath)
    out = []
    for qualname, owner, node in _functions(tree):
        doc = ast.get_docstring(node)
        if not doc or not doc.strip():
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        code = textwrap.dedent("".join(lines[first - 1 : node.end_lineno])).rstrip() + "\n"
        if len(code) > MAX_FUNCTION_CHARS:
            continue
        prompt = _request(node, owner, doc)
        out.append(Conversation(relpath, qualname, first, split, prompt, code))
    return out


def build_corpus(root: Path | None = None) -> list[Conversation]:
    """All conversations, in file then line order, deduplicated by answer text.

    Files are processed in sorted order and the first copy of an answer is kept; a held-out
    function whose code also occurs in a training file is dropped, so the held-out split
    shares neither files nor code with training.
    """
    root = root or stdlib_root()
    per_split: dict[str, list[Conversation]] = {"train": [], "heldout": []}
    for relpath in stdlib_files(root):
        for conv in conversations_of_file(root, relpath):
            per_split[conv.split].append(conv)
    seen: set[str] = set()
    kept: list[Conversation] = []
    for split in ("train", "heldout"):
        for conv in per_split[split]:
            if conv.answer not in seen:
                seen.add(conv.answer)
                kept.append(conv)
    return sorted(kept, key=lambda c: (c.source, c.lineno, c.name))


def stdlib_fingerprint(root: Path) -> str:
    """sha256 over the names and contents of the files build_corpus reads (its only input)."""
    h = hashlib.sha256()
    for relpath in stdlib_files(root):
        h.update(relpath.encode() + b"\0" + hashlib.sha256((root / relpath).read_bytes()).digest())
    return "sha256:" + h.hexdigest()


def corpus_fingerprint(corpus: Sequence[Conversation]) -> str:
    """sha256 over every conversation (source, split, messages, name, line), in corpus order."""
    h = hashlib.sha256()
    for conv in corpus:
        h.update(json.dumps(conv.to_json(), sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def check_subset(heldout: Sequence[Conversation], n: int) -> list[Conversation]:
    """A fixed, well-spread subset: the n held-out conversations with the smallest answer hash."""
    return sorted(heldout, key=lambda c: hashlib.sha256(c.answer.encode()).hexdigest())[:n]


def write_corpus_jsonl(conversations: Sequence[Conversation], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for conv in conversations:
            f.write(json.dumps(conv.to_json(), ensure_ascii=False) + "\n")
