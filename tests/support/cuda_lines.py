"""How many CUDA-only lines of eagle3_train the cuda_dry_run tier runs (issue 44's measure).

    PYTHONPATH=tests uv run python -m support.cuda_lines     # both runs: ~10 min on 2 cores
    PYTHONPATH=tests uv run python -m support.cuda_lines --tier-only    # the static count, ~1 min

Two runs of pytest, each in its own process under a line tracer on eagle3_train's files (the
lines each run executed, as coverage.py's line coverage would record them; coverage.py is not
in uv.lock and a ``sys.settrace`` tracer is what it does on Python 3.11):

- the CPU run: eagle3-train's own tests (``packages/eagle3-train/tests``) minus the tiers that
  start other processes (``distributed``, ``vllm``, ``tmpfs``, ``process``, ``slow``): every
  line of eagle3_train a CPU test executes in the test process;
- the tier: ``-m cuda_dry_run tests/test_cuda_dry_run.py``.

A CUDA-only line is the union of two sets, both printed with their source so they can be read:

- static: a statement in the body of an ``if`` whose test names CUDA (``is_cuda``,
  ``device.type == "cuda"``, ``torch.cuda...``, a variable named ``cuda``), in the ``else`` of
  one that tests for not-CUDA (``if not x.is_cuda``, ``device.type != "cuda"``), after an
  ``if not cuda: return``, or the CUDA arm of a conditional expression on CUDA;
- dynamic: a line the tier executes that the CPU run does not (a line reached there only
  through code that is not under such an ``if``, e.g. the FlashAttention-2 wrapper chosen by
  ``resolve_attention``, or the bf16 GEMM branch chosen by a dtype).

The count is the CUDA-only lines the tier executed. Lines executed only in the child processes
of the excluded tiers are not seen by the CPU run: a dynamic line could be one of those (read
the printed list); none of the static ones can, by their ``if``.
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


def _blocks(node: ast.AST) -> list[list[ast.stmt]]:
    return [
        getattr(node, name)
        for name in ("body", "orelse", "finalbody")
        if isinstance(getattr(node, name, None), list)
    ]


def static_cuda_lines(path: Path) -> set[int]:
    """The lines of ``path`` under a CUDA ``if`` (the static definition above)."""
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier-only", action="store_true", help="the static count only")
    parser.add_argument("--trace", type=Path, help=argparse.SUPPRESS)  # a child run
    parser.add_argument("pytest_args", nargs="*", help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    if a.trace:
        rc, ran = trace_pytest(a.pytest_args)
        a.trace.write_text(json.dumps({f: sorted(v) for f, v in ran.items()}))
        return rc

    static = {
        str(p.relative_to(ROOT)): lines
        for p in sorted(ROOT.rglob("*.py"))
        if (lines := static_cuda_lines(p))
    }
    tier, tier_s = _run_traced(TIER_RUN)
    print(f"the tier under the tracer: {tier_s:.0f} s")
    static_hit = _report("static", static, tier)
    if a.tier_only:
        return 0
    cpu, cpu_s = _run_traced(CPU_RUN)
    print(f"the CPU run under the tracer: {cpu_s:.0f} s")
    dynamic = {f: v - cpu.get(f, set()) for f, v in tier.items()}
    _report("dynamic (tier, not CPU)", {f: v for f, v in dynamic.items() if v}, tier)
    static_run_on_cpu = sum(len(v & cpu.get(f, set())) for f, v in static.items())
    print(f"static lines the CPU run executed (0 expected): {static_run_on_cpu}")
    union = {f: static.get(f, set()) | dynamic.get(f, set()) for f in set(static) | set(dynamic)}
    count = _report("CUDA-only (static | dynamic)", {f: v for f, v in union.items() if v}, tier)
    print(f"CUDA-only lines run by the cuda_dry_run tier: {count} (floor {FLOOR}), static {static_hit}")
    return 0 if count >= FLOOR else 1


if __name__ == "__main__":
    raise SystemExit(main())
