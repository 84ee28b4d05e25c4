"""The documentation a person reads matches the code, checked in the quick tier (no engine, no
process): every repository path a page names exists, every ``--flag`` shown for one of our
commands is accepted by that command's own parser, every config key named exists in the config
dataclasses and every one of them is in the generated reference, and the README's results
summary holds only figures of the result files under docs/benchmarks/.

The pages are README.md, CHANGELOG.md, docs/, the packages' and tools' READMEs and the recipes'
resource sheets. Generated pages (docs/configuration.md, the benchmark tables) must equal what
their tools in tools/docs/ render from the code and the result files.
"""

from __future__ import annotations

import argparse
import json
import re
from functools import cache
from pathlib import Path
from types import ModuleType

import pytest
from accelerate.commands.launch import launch_command_parser

from support.doc_commands import bash_lines, flag_problems, our_command, stage_parsers, words_of
from support.scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    {
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("packages/*/README.md"),
        ROOT / "tools" / "README.md",
        *ROOT.glob("recipes/*/RESOURCES.md"),
    }
)
# A repository path named in a page's text: a top-level folder of the repository, then a path.
REPO_PATH = re.compile(r"(?<![\w./~-])(?:packages|recipes|tools|tests|schemas|docs)/[\w./*{}$<>-]*")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CONFIG_KEY = re.compile(r"(?<![\w./$-])(?:target|draft|data|train|export)(?:\.[a-z_][a-z0-9_]*)+")
FILE_SUFFIXES = {"yaml", "yml", "py", "parquet", "jsonl", "json", "md", "safetensors", "sh", "png"}


def _shown(page: Path) -> str:
    return str(page.relative_to(ROOT))


@cache
def _tool(name: str) -> ModuleType:
    return load_script(ROOT / "tools" / "docs" / f"{name}.py")


def _code(text: str) -> list[str]:
    """The page's code: fenced blocks and inline spans."""
    fenced = re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S)
    prose = re.sub(r"```[^\n]*\n.*?```", "", text, flags=re.S)
    return fenced + re.findall(r"`([^`\n]+)`", prose)


@cache
def _parsers() -> dict[str, argparse.ArgumentParser]:
    return stage_parsers()


def missing_paths(page: Path) -> list[str]:
    """Repository paths and relative links of the page that name no file or folder."""
    text = page.read_text(encoding="utf-8")
    # A recipe folder the page's own `eagle3-recipe new --name NAME` writes exists only then.
    written = tuple(f"recipes/{n}" for n in re.findall(r"eagle3-recipe new .*--name (\S+)", text))
    problems = []
    for raw in REPO_PATH.findall(text):
        path = re.sub(r":\d+$", "", raw.rstrip(".,:;)"))
        if re.search(r"[*{}$<>]", path) or not path.strip("/"):
            continue  # a pattern or a placeholder, not one path
        if written and path.startswith(written):
            continue
        if not (ROOT / path).exists():
            problems.append(f"{_shown(page)} names {path}, which does not exist")
    for target in LINK.findall(text):
        target = target.split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue
        if not (page.parent / target).exists():
            problems.append(f"{_shown(page)} links {target}, which does not exist")
    return problems


def flag_mistakes(page: Path) -> list[str]:
    """Each command of ours the page shows (bash blocks and inline code spans) with an option or
    subcommand its parser lacks; accelerate's own options against accelerate's parser."""
    parsers = _parsers()
    text = page.read_text(encoding="utf-8")
    inline = [c for c in _code(text) if "\n" not in c]
    problems = []
    for line in [*bash_lines(text), *inline]:
        try:
            words = words_of(line)
        except ValueError:
            continue  # prose in a code span, not a command line
        found = our_command(words)
        if found is None:
            continue
        name, args = found
        problems += [
            f"{_shown(page)}: `{line.strip()}`: {p}" for p in flag_problems(parsers[name], args)
        ]
        if words[:2] == ["accelerate", "launch"] and "-m" in words:
            own = words[2 : words.index("-m")]
            options = {o for a in launch_command_parser()._actions for o in a.option_strings}
            problems += [
                f"{_shown(page)}: `{line.strip()}`: accelerate launch has no option {w}"
                for w in own
                if w.startswith("--") and w.split("=")[0] not in options
            ]
    return problems


@cache
def _config_names() -> frozenset[str]:
    """Every config key and section, dotted (train, train.muon, train.muon.lr)."""
    names = set()
    for key in _tool("config_reference").config_keys():
        parts = key.split(".")
        names |= {".".join(parts[: i + 1]) for i in range(len(parts))}
    return frozenset(names)


def unknown_config_keys(page: Path) -> list[str]:
    problems = []
    for code in _code(page.read_text(encoding="utf-8")):
        for key in CONFIG_KEY.findall(code):
            if key.rsplit(".", 1)[-1] in FILE_SUFFIXES:
                continue  # a file name (train.yaml), not a key
            if key not in _config_names():
                problems.append(f"{_shown(page)} names config key {key}, which does not exist")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=_shown)
def test_every_path_named_exists(page: Path) -> None:
    assert not missing_paths(page)


@pytest.mark.parametrize("page", PAGES, ids=_shown)
def test_every_flag_shown_is_accepted(page: Path) -> None:
    assert not flag_mistakes(page)


@pytest.mark.parametrize("page", PAGES, ids=_shown)
def test_every_config_key_named_exists(page: Path) -> None:
    assert not unknown_config_keys(page)


def test_the_configuration_reference_is_generated_and_complete() -> None:
    tool = _tool("config_reference")
    page = tool.PAGE.read_text(encoding="utf-8")
    missing = [k for k in tool.config_keys() if f"| `{k}` |" not in page]
    assert not missing, f"docs/configuration.md lacks {missing}"
    assert page == tool.render(), (
        "docs/configuration.md is stale: run tools/docs/config_reference.py"
    )


def test_the_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200)"


SUMMARY = re.compile(r"<!-- summary -->\n(.*?)<!-- /summary -->", re.S)
FIGURE = re.compile(r"(?<![\w.])\d+\.\d{3}(?![\d])")


def result_figures(name: str) -> set[str]:
    """Every figure a result file holds or yields (values, means, ranges), as rendered."""
    tool = _tool("render_benchmarks")
    arms = []
    for table in tool.load(name)["tables"]:
        for row in table["rows"]:
            if isinstance(row, dict) and ("seeds" in row or "summary" in row):
                arms.append(tool.Arm(row))
            elif isinstance(row, list):
                arms += [tool.Arm(cell) for cell in row if isinstance(cell, dict)]
    shown = set()
    for arm in arms:
        values = [
            arm.mean,
            arm.low,
            arm.high,
            *arm.seeds.values(),
            *arm.row.get("per_position", []),
        ]
        shown |= {tool.f3(v) for v in values}
    return shown


def result_files() -> list[str]:
    return sorted(p.stem for p in (ROOT / "docs" / "benchmarks").glob("*.json"))


def unsourced_readme_figures(readme: str) -> list[str]:
    """Figures of the README's results summary that no result file under docs/benchmarks/
    holds or yields (a mean, a range end, a seed's value)."""
    block = SUMMARY.search(readme)
    assert block, "README.md has no <!-- summary --> block"
    known: set[str] = set()
    for name in result_files():
        known |= result_figures(name)
    return [f for f in FIGURE.findall(block.group(1)) if f not in known]


def test_every_readme_summary_figure_comes_from_a_result_file() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert not unsourced_readme_figures(readme)
    rows = [r for r in SUMMARY.search(readme).group(1).splitlines() if r.startswith("| ")]
    assert 1 <= len(rows) - 1 <= 6, "the results summary has a header and 1 to 6 rows"


def test_every_result_file_states_its_command_date_and_versions() -> None:
    tool = _tool("render_benchmarks")
    for name in result_files():
        data = tool.load(name)
        assert data["command"] and data["measured"] and data["versions"], name
        assert not re.search(r"\b[0-9a-f]{7,40}\b", json.dumps(data)), f"{name}: a commit hash"


def test_the_benchmark_tables_and_summary_are_rendered_from_the_result_files() -> None:
    tool = _tool("render_benchmarks")
    stale = [
        _shown(p)
        for p in tool.pages()
        if tool.rendered(p.read_text("utf-8")) != p.read_text("utf-8")
    ]
    assert not stale, f"stale: {stale}; run tools/docs/render_benchmarks.py"


def test_tools_readme_names_every_tool() -> None:
    """tools/README.md names each file a person may run (a new tool is listed as it lands)."""
    text = (ROOT / "tools" / "README.md").read_text(encoding="utf-8")
    tools = [
        p
        for p in sorted((ROOT / "tools").rglob("*"))
        if p.is_file() and p.suffix in (".py", ".sh") and "__pycache__" not in p.parts
    ]
    assert tools
    assert not [_shown(p) for p in tools if f"`{p.name}`" not in text]


def test_the_recipes_page_names_every_recipe() -> None:
    text = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    recipes = [p.name for p in sorted((ROOT / "recipes").iterdir()) if (p / "train.yaml").is_file()]
    assert recipes
    assert not [r for r in recipes if f"recipes/{r}" not in text]
