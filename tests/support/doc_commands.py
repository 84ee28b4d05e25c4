"""The commands a documentation page shows, read as the stages' own parsers read them.

Shared by the tests that keep pages of commands honest (tests/test_multinode_doc.py,
tests/test_docs.py): a renamed flag or subcommand fails a test here, not a user's job.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable, Iterable
from pathlib import Path
from unittest import mock

# Our console scripts, and `python -m` names of the ones run under `accelerate launch`.
COMMANDS = (
    "eagle3-data",
    "eagle3-extract",
    "eagle3-train",
    "eagle3-eval",
    "eagle3-schemas",
    "eagle3-recipe",
)
MODULES = {"eagle3_train": "eagle3-train", "eagle3_extract": "eagle3-extract"}


def bash_lines(text: str) -> list[str]:
    """The lines of a page's ```bash blocks, continuations joined, comment lines dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                lines.append(line)
    return lines


def words_of(line: str, values: dict[str, str] | None = None) -> list[str]:
    """A command line's words: shell values filled with a stand-in (``values[NAME]``, else '1':
    a valid int and a valid path), comments, leading VAR=value words, a trailing '&' and a
    leading ``uv run [--frozen]`` dropped."""
    line = re.sub(
        r"\$\(\([^)]*\)\)|\$\{?(\w+)\}?",
        lambda m: (values or {}).get(m.group(1) or "", "1"),
        line,
    )
    words = shlex.split(line.rstrip().removesuffix("&"), comments=True)  # a background job
    while words and re.fullmatch(r"\w+=\S*", words[0]):
        words.pop(0)
    if words[:2] == ["uv", "run"]:
        words = words[2:]
        while words and words[0].startswith("--"):
            words.pop(0)
    return words


def commands(
    doc: Path, starts: Iterable[str], values: dict[str, str] | None = None
) -> list[list[str]]:
    """Each command line of the page's bash blocks whose first word is one of ``starts``."""
    wanted = set(starts)
    found = []
    for line in bash_lines(doc.read_text(encoding="utf-8")):
        words = words_of(line, values)
        if words and words[0] in wanted:
            found.append(words)
    return found


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(main: Callable[[list[str] | None], int]) -> argparse.ArgumentParser:
    """The parser a console script's ``main`` builds, caught when it parses: nothing runs."""

    def caught(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Built(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", caught):
        try:
            main([])
        except _Built as built:
            return built.parser
    raise AssertionError(f"{main} returned without parsing its arguments")


def stage_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each of our console scripts' parsers, by command name."""
    from eagle3_data.cli import main as data_main
    from eagle3_eval.cli import main as eval_main
    from eagle3_extract.cli import main as extract_main
    from eagle3_recipe.cli import main as recipe_main
    from eagle3_schemas.cli import main as schemas_main
    from eagle3_train.cli import main as train_main

    mains = (data_main, extract_main, train_main, eval_main, schemas_main, recipe_main)
    return {name: parser_of(main) for name, main in zip(COMMANDS, mains, strict=True)}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def flag_problems(parser: argparse.ArgumentParser, words: list[str]) -> list[str]:
    """What the parser would not accept of ``words`` (the arguments after the command name):
    an unknown subcommand, or a ``--flag`` none of its options spells out in full."""
    problems = []
    chain = [parser.prog]
    rest = list(words)
    while subs := _subcommands(parser):
        positional = next((w for w in rest if not w.startswith("-")), None)
        if positional is None or positional == "...":
            return []  # the command named, not shown with arguments
        if positional not in subs:
            return [f"{' '.join(chain)}: no subcommand {positional!r} (has {sorted(subs)})"]
        parser = subs[positional]
        chain.append(positional)
        rest = rest[rest.index(positional) + 1 :]
    options = {o for action in parser._actions for o in action.option_strings}
    for word in rest:
        flag = word.split("=", 1)[0]
        if flag.startswith("--") and flag != "--" and flag not in options:
            problems.append(f"{' '.join(chain)}: no option {flag}")
    return problems


def our_command(words: list[str]) -> tuple[str, list[str]] | None:
    """(our command, its arguments) of a command line: run directly, as ``python -m``, or under
    ``accelerate launch [...] -m eagle3_train`` / ``accelerate launch "$(which eagle3-train)"``."""
    if not words:
        return None
    if words[0] in COMMANDS:
        return words[0], words[1:]
    for i, word in enumerate(words[:-1]):
        if word == "-m" and words[i + 1] in MODULES:
            return MODULES[words[i + 1]], words[i + 2 :]
        if re.fullmatch(r"\$\(which (eagle3-\w+)\)", word):
            return word[len("$(which ") : -1], words[i + 1 :]
    if words[:2] == ["accelerate", "launch"]:
        name = next((w for w in words[2:] if w in COMMANDS), None)
        if name:
            return name, words[words.index(name) + 1 :]
    return None
