"""How many CUDA-only lines of eagle3_train the cuda_dry_run tier runs (issue 44's measure).

    PYTHONPATH=tests uv run python -m support.cuda_lines     # ~2 min; exit 1 below FLOOR

Two runs of pytest, each in its own process under a line tracer on eagle3_train's files (the
lines each run executed, as coverage.py's line coverage would record them; coverage.py is not
in uv.lock and a ``sys.settrace`` tracer is what it does on Python 3.11):

- the CPU run: eagle3-train's own tests (``packages/eagle3-train/tests``) minus the tiers that
  start other processes (``distributed``, ``vllm``, ``tmpfs``, ``process``, ``slow``): every
  line of eagle3_train a CPU test executes in the test process;
- the tier: ``-m cuda_dry_run tests/test_cuda_dry_run.py``.

A CUDA-only line is a statement under a branch whose test is a CUDA decision, that the CPU run
does not execute:

- the branch: the body of an ``if`` whose test names CUDA (``is_cuda``, ``device.type ==
  "cuda"``, ``torch.cuda...``, a variable named ``cuda``), the ``else`` of one that tests for
  not-CUDA (``if not x.is_cuda``, ``device.type != "cuda"``), the rest of a block after
  ``if not cuda: return``, the CUDA arm of a conditional expression on CUDA when on a line of
  its own; and three tests that decide CUDA under other names: ``device.type != "cpu"``,
  ``mixed_precision == "bf16"`` (``auto`` is bf16 only on CUDA) and ``compile_enabled(...)``
  (``auto`` compiles only on CUDA);
- and, transitively, the body of a function of eagle3_train whose every use (a call or a
  reference, by its name, anywhere in the package) is such a statement, e.g.
  ``Eagle3Draft.store_frozen_as``, used only under ``mixed_precision == "bf16"``;
- minus every line the CPU run executed (printed: such a line also runs on CPU, e.g. the CUDA
  arm of a conditional expression over several lines, which Python reports whichever arm).

Also printed, not counted: the lines only the tier executes that are under no such branch (no
in-process CPU test runs them, e.g. DeepSpeed's Muon builder: the distributed tier runs it in
its own processes). The count is not asserted by a test: the two runs take about twice the
tier's own time (the tier alone: ~27 s warm).
"""

from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import eagle3_train

ROOT = Path(eagle3_train.__file__).resolve().parent
CPU_RUN = [
    "packages/eagle3-train/tests",
    "-m",
    "not slow and not distributed and not vllm and not tmpfs and not process",
]
TIER_RUN = ["-m", "cuda_dry_run", "tests/test_cuda_dry_run.py"]
FLOOR = 38  # issue 44: the tier covers at least this many CUDA-only lines


# as ast.unparse writes them (single quotes)
OTHER_GATES = ("!= 'cpu'", "mixed_precision == 'bf16'", "compile_enabled(")


def _cuda_arm(test: ast.expr) -> str | None:
    """Which arm of an ``if`` on ``test`` runs only on CUDA: "body", "orelse" or None."""
    text = ast.unparse(test)
    negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
    if "cuda" in text:
        return "orelse" if negated or "!=" in text else "body"
    if any(gate in text for gate in OTHER_GATES):
        return "orelse" if negated else "body"
    return None


def _lines(stmts: list[ast.stmt]) -> set[int]:
    out: set[int] = set()
    for stmt in stmts:
        for node in ast.walk(stmt):
            if isinstance(node, ast.stmt):
                out.add(node.lineno)
    return out


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    return [
        getattr(node, name)
        for name in ("body", "orelse", "finalbody")
        if isinstance(getattr(node, name, None), list)
    ]


def static_cuda_lines(path: Path) -> set[int]:
    """The statements of ``path`` under a CUDA ``if`` or conditional expression."""
    tree = ast.parse(path.read_text())
    lines: set[int] = set()
    for node in ast.walk(tree):
        for block in _blocks(node):
            for i, stmt in enumerate(block):
                arm = _cuda_arm(stmt.test) if isinstance(stmt, ast.If) else None
                if arm == "body":
                    lines |= _lines(stmt.body)
                elif arm == "orelse" and stmt.orelse:
                    lines |= _lines(stmt.orelse)
                elif arm == "orelse" and isinstance(stmt.body[-1], ast.Return):
                    lines |= _lines(block[i + 1 :])  # ``if not cuda: return``: the rest
        if isinstance(node, ast.IfExp) and (arm := _cuda_arm(node.test)):
            line = node.body.lineno if arm == "body" else node.orelse.lineno
            if line != node.test.lineno:  # on one line with its test, both arms run it
                lines.add(line)
    return lines


def _statement_of(tree: ast.Module) -> dict[ast.AST, int]:
    """Each node's innermost enclosing statement's line."""
    out: dict[ast.AST, int] = {}

    def visit(node: ast.AST, line: int) -> None:
        for child in ast.iter_child_nodes(node):
            here = child.lineno if isinstance(child, ast.stmt) else line
            out[child] = here
            visit(child, here)

    visit(tree, 0)
    return out


def cuda_only_branches(files: list[Path]) -> dict[str, set[int]]:
    """Every file's statements under a CUDA decision, with the bodies of the functions used
    only there (to a fixed point)."""
    trees = {str(p.relative_to(ROOT)): ast.parse(p.read_text()) for p in files}
    lines = {f: static_cuda_lines(ROOT / f) for f in trees}
    defs: dict[str, list[tuple[str, ast.AST]]] = {}
    uses: dict[str, list[tuple[str, int]]] = {}
    for f, tree in trees.items():
        where = _statement_of(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                defs.setdefault(node.name, []).append((f, node))
            name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
            if isinstance(node, ast.Name | ast.Attribute) and isinstance(node.ctx, ast.Load):
                uses.setdefault(name, []).append((f, where[node]))
    grew = True
    while grew:
        grew = False
        for name, found in defs.items():
            if len(found) != 1 or not uses.get(name):  # one definition of the name, used
                continue
            f, node = found[0]
            body = _lines(
                [
                    s
                    for s in node.body  # no line event: the docstring, ``global``
                    if not isinstance(s, ast.Global | ast.Nonlocal)
                    and not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
                ]
            )
            if all(line in lines[uf] for uf, line in uses[name]) and not body <= lines[f]:
                lines[f] |= body
                grew = True
    return {f: v for f, v in lines.items() if v}


Lines = dict[str, set[int]]  # file relative to eagle3_train -> line numbers


def trace_pytest(args: list[str]) -> tuple[int, Lines]:
    """Run pytest with ``args`` in this process; the eagle3_train lines it executed."""
    import pytest

    prefix = str(ROOT) + "/"
    ran: dict[str, set[int]] = {}

    def local(frame, event, arg):
        if event == "line":
            ran[frame.f_code.co_filename].add(frame.f_lineno)
        return local

    def on_call(frame, event, arg):
        name = frame.f_code.co_filename
        if not name.startswith(prefix):
            return None
        ran.setdefault(name, set())
        return local

    sys.settrace(on_call)
    threading.settrace(on_call)
    try:
        rc = pytest.main(["-q", "-p", "no:cacheprovider", *args])
    finally:
        sys.settrace(None)
        threading.settrace(None)
    return int(rc), {str(Path(f).relative_to(ROOT)): lines for f, lines in ran.items()}


def _run_traced(args: list[str]) -> tuple[Lines, float]:
    """``trace_pytest`` in a fresh interpreter (the two runs must not share imported state)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "lines.json"
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "support.cuda_lines", "--trace", str(out), "--", *args]
        )
        seconds = time.monotonic() - start
        if proc.returncode != 0:
            raise SystemExit(f"pytest {' '.join(args)} failed (exit {proc.returncode})")
        return {f: set(v) for f, v in json.loads(out.read_text()).items()}, seconds


def _report(kind: str, lines: Lines, ran: Lines) -> int:
    hit_total = total = 0
    for f in sorted(lines):
        source = (ROOT / f).read_text().splitlines()
        hit = lines[f] & ran.get(f, set())
        hit_total, total = hit_total + len(hit), total + len(lines[f])
        print(f"{kind} {f}: {len(hit)}/{len(lines[f])}")
        for n in sorted(lines[f]):
            print(f"  {'ran ' if n in hit else 'NOT '} {n:4d}  {source[n - 1].strip()[:90]}")
    print(f"{kind}: the tier ran {hit_total} of {total}")
    return hit_total


def _nonempty(lines: Lines) -> Lines:
    return {f: v for f, v in lines.items() if v}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)  # a child run
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.trace:
        rc, ran = trace_pytest(a.pytest_args)
        a.trace.write_text(json.dumps({f: sorted(v) for f, v in ran.items()}))
        return rc

    branch = cuda_only_branches(sorted(ROOT.rglob("*.py")))
    tier, tier_s = _run_traced(TIER_RUN)
    cpu, cpu_s = _run_traced(CPU_RUN)
    print(f"under the tracer: the tier {tier_s:.0f} s, the CPU run {cpu_s:.0f} s")
    _report(
        "under a CUDA branch but run on CPU too (not counted)",
        _nonempty({f: v & cpu.get(f, set()) for f, v in branch.items()}),
        tier,
    )
    _report(
        "only the tier runs, under no CUDA branch (not counted)",
        _nonempty({f: v - cpu.get(f, set()) - branch.get(f, set()) for f, v in tier.items()}),
        tier,
    )
    only = _nonempty({f: v - cpu.get(f, set()) for f, v in branch.items()})
    count = _report("CUDA-only", only, tier)
    print(f"CUDA-only lines run by the cuda_dry_run tier: {count} (floor {FLOOR})")
    return 0 if count >= FLOOR else 1


if __name__ == "__main__":
    raise SystemExit(main())
