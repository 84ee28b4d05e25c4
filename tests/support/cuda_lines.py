"""How many CUDA-only lines of eagle3_train the cuda_dry_run tier runs (issue 44's measure).

A CUDA-only line: a statement in the body of an ``if`` whose test names CUDA (``is_cuda``,
``device.type == "cuda"``, ``torch.cuda...``, a variable named ``cuda``), or in the ``else`` of
one that tests for not-CUDA (``if not x.is_cuda``, ``device.type != "cuda"``): on a machine
without a GPU no other test reaches them. The tier runs in this process with a line tracer
on eagle3_train's files; the lines it ran are intersected with the CUDA-only ones.

    PYTHONPATH=tests uv run python -m support.cuda_lines      # ~1-2 min on 2 cores
"""

from __future__ import annotations

import ast
import sys
import threading
from pathlib import Path

import eagle3_train

ROOT = Path(eagle3_train.__file__).resolve().parent


def _names_cuda(node: ast.expr) -> bool:
    return "cuda" in ast.unparse(node)


def _negated(test: ast.expr) -> bool:
    text = ast.unparse(test)
    return (isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)) or "!=" in text


def _lines(stmts: list[ast.stmt]) -> set[int]:
    out: set[int] = set()
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.stmt):
                out.add(node.lineno)
    return out


def cuda_only_lines(path: Path) -> set[int]:
    tree = ast.parse(path.read_text())
    lines: set[int] = set()
    for node in ast.walk(tree):
        for block in _blocks(node):
            for i, stmt in enumerate(block):
                if not (isinstance(stmt, ast.If) and _names_cuda(stmt.test)):
                    continue
                if not _negated(stmt.test):
                    lines |= _lines(stmt.body)
                elif stmt.orelse:
                    lines |= _lines(stmt.orelse)
                elif isinstance(stmt.body[-1], ast.Return):  # ``if not cuda: return``: the rest
                    lines |= _lines(block[i + 1 :])
        if isinstance(node, ast.IfExp) and _names_cuda(node.test):
            lines.add(node.lineno if not _negated(node.test) else node.orelse.lineno)
    return lines


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    return [
        getattr(node, name)
        for name in ("body", "orelse", "finalbody")
        if isinstance(getattr(node, name, None), list)
    ]


def main() -> int:
    import pytest

    files = {str(p): cuda_only_lines(p) for p in ROOT.rglob("*.py")}
    files = {f: lines for f, lines in files.items() if lines}
    ran: dict[str, set[int]] = {f: set() for f in files}

    def tracer(frame, event, arg):
        name = frame.f_code.co_filename
        if name not in ran:
            return None
        if event == "line":
            ran[name].add(frame.f_lineno)
        return tracer

    def global_tracer(frame, event, arg):
        return tracer if frame.f_code.co_filename in ran else None

    sys.settrace(global_tracer)
    threading.settrace(global_tracer)
    try:
        rc = pytest.main(
            ["-q", "-p", "no:cacheprovider", "-m", "cuda_dry_run", "tests/test_cuda_dry_run.py"]
        )
    finally:
        sys.settrace(None)
        threading.settrace(None)
    total = covered = 0
    for f, lines in sorted(files.items()):
        hit = lines & ran[f]
        total += len(lines)
        covered += len(hit)
        missed = sorted(lines - hit)
        print(
            f"{Path(f).relative_to(ROOT)}: {len(hit)}/{len(lines)} CUDA-only lines; not run: {missed}"
        )
    print(f"CUDA-only lines run by the cuda_dry_run tier: {covered} of {total}")
    return int(rc)


if __name__ == "__main__":
    raise SystemExit(main())
