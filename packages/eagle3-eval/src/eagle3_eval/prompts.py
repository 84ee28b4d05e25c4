"""The prompt sets: benchmark files and held-out conversations, rendered with the target's
chat template, each prompt tagged with its set and category.

``--prompts NAME=PATH`` (repeatable; a plain PATH is named by its format, or its file name for
conversations) names a set; ``prompt_files`` reads the formats sets ship in (MT-Bench,
HumanEval, GSM8K, chat JSONL / ShareGPT / Parquet). A conversation's prompt is every message
before its last assistant turn, rendered with ``add_generation_prompt``.

Held out by construction, for conversation files: a row is used only when its ``split``
equals the requested split and/or its source file is listed as held out
(``--heldout-sources``: a JSON list, or a JSON object with a ``heldout_sources`` list such as
the tiny target's build_info.json). A source ``path:line`` counts by its path. Without either
proof the set is refused, unless the caller says ``allow_unverified`` — and then the report
says so. A benchmark file (MT-Bench, HumanEval, GSM8K) is held out by its publisher; the
report says it was not checked against the training data.

Multi-turn sets (MT-Bench): a later turn is a ``FollowUp``; its prompt exists only once the
target has answered the turn before (``follow_up_prompts``), which each mode does first.

Kinds of traffic, one per prompt, so one file can hold all three (``KINDS``):

- ``agent``: the row declares tools (its ``tools``); its prompt ends at a user turn or after a
  tool result. It is rendered in its mode too (an agent thinks or not), but counted as agent.
- ``thinking`` / ``instant``: no tools; the row's mode (its ``mode``, else its ``kind``, else
  derived as ingest derives it: ``prompt_files``), else the run's default mode.

The run's default mode is what the target's template renders without a mode, given the run's
``--chat-template-kwarg``s: a one-turn probe is rendered as is and in either mode; a template
that renders both modes alike has none (``instant``); a probe matching neither mode cannot be
classified, and a row relying on it is refused, naming its file, line and field ``mode``.
A row with a mode of its own or declared tools is rendered as the data stage renders a
generation event's prompt (``eagle3_schemas.layouts.conversations.render_prompt``: tools and mode
over the run's kwargs); any other prompt with the run's kwargs alone, as before kinds existed.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3_eval.prompt_files import KINDS, Item, PromptFileError, read_items
from eagle3_schemas.contract.lineage import fingerprint_file, fingerprint_json
from eagle3_schemas.layouts.conversations import NO_TOOLS, render_prompt

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class PromptError(ValueError):
    """The prompt set cannot be built as asked."""


@dataclass(frozen=True)
class PromptSource:
    """One ``--prompts``: a set's name (None: named by its format or file) and its file."""

    name: str | None
    path: Path

    @classmethod
    def parse(cls, text: str) -> PromptSource:
        """``NAME=PATH`` or ``PATH``."""
        name, sep, path = text.partition("=")
        if sep and NAME.fullmatch(name) and path:
            return cls(name, Path(path))
        return cls(None, Path(text))


@dataclass(frozen=True)
class Prompt:
    sample_id: str
    source: str
    messages: list[dict[str, Any]]
    token_ids: list[int]
    prompt_set: str = "prompts"
    category: str | None = None
    turn: int = 1
    kind: str = "instant"  # one of KINDS
    tools: str = NO_TOOLS  # the declared tools (JSON text) it is rendered with
    mode: str | None = None  # the mode it is rendered in; None: the run's kwargs alone


@dataclass(frozen=True)
class FollowUp:
    """A later user turn, asked after the target's own answer to the prompt ``after``."""

    sample_id: str
    after: str
    user: str
    prompt_set: str
    category: str | None
    turn: int


@dataclass(frozen=True)
class PromptSet:
    prompts: list[Prompt]
    description: dict[str, Any]  # goes into the report: files, selection, counts, fingerprint
    followups: list[FollowUp] = field(default_factory=list)

    @property
    def fingerprint(self) -> str:
        return str(self.description["fingerprint"])


@dataclass(frozen=True)
class PromptSelection:
    sources: tuple[PromptSource, ...]
    split: str | None = "heldout"
    heldout_sources: Path | None = None
    limit: int | None = None
    max_prompt_tokens: int = 1024
    allow_unverified: bool = False


def read_heldout_sources(path: Path) -> set[str]:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise PromptError(f"{path}: cannot read held-out sources ({e})") from e
    sources = obj.get("heldout_sources") if isinstance(obj, dict) else obj
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise PromptError(
            f"{path}: expected a JSON list of source names or an object with 'heldout_sources'"
        )
    return set(sources)


def source_file(source: str) -> str:
    """'lib/foo.py:12' -> 'lib/foo.py' (a source names a file, optionally a line in it)."""
    head, sep, tail = source.rpartition(":")
    return head if sep and tail.isdigit() else source


def select(items: list[Item], path: Path, selection: PromptSelection) -> tuple[list[Item], str]:
    """Conversations held out by construction, and a sentence saying how that was established."""
    heldout = read_heldout_sources(selection.heldout_sources) if selection.heldout_sources else None
    has_split = any("split" in item.row for item in items)
    if selection.split is not None and not has_split and heldout is None:
        raise PromptError(
            f"{path}: rows carry no 'split' field; pass --heldout-sources or "
            "--split none with --allow-unverified-prompts"
        )
    kept = []
    for item in items:
        row = item.row
        source = str(row.get("source", ""))
        if selection.split is not None and has_split and row.get("split") != selection.split:
            continue
        if heldout is not None:
            if not source:
                raise PromptError(f"{path}: row {item.key!r} has no 'source'")
            if source_file(source) not in heldout:
                if selection.split is not None and has_split:
                    # Both proofs were given and they disagree: that is a broken split.
                    raise PromptError(
                        f"{path}: row with source {source!r} has split "
                        f"{row.get('split')!r} but its file is not among the held-out sources "
                        f"of {selection.heldout_sources}"
                    )
                continue
        kept.append(item)
    rules = []
    if selection.split is not None and has_split:
        rules.append(f"split == {selection.split!r}")
    if heldout is not None:
        rules.append(f"source file in {selection.heldout_sources} ({len(heldout)} files)")
    if not rules:
        if not selection.allow_unverified:
            raise PromptError(
                f"{path}: nothing proves these prompts are held out from training; "
                "give --heldout-sources or use rows with a 'split' field "
                "(or --allow-unverified-prompts)"
            )
        rules.append("UNVERIFIED: no held-out proof given")
    return kept, " and ".join(rules)


# (messages, tools, mode) -> prompt token ids; mode None: the run's template kwargs alone.
Renderer = Callable[[Sequence[dict[str, Any]], str, str | None], list[int]]


def renderer(tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> Renderer:
    """Messages -> prompt token ids, ending with the assistant's header; ``template_kwargs``
    (the run's) under the row's tools and mode where it has them."""
    run = dict(template_kwargs or {})

    def render(messages: Sequence[dict[str, Any]], tools: str, mode: str | None) -> list[int]:
        if mode is None:
            text = tokenizer.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=True, **run
            )
        else:
            text = render_prompt(tokenizer, messages, tools, mode, run)
        # The template writes the special tokens itself; the tokenizer must not add more.
        return list(tokenizer.encode(text, add_special_tokens=False))

    return render


def default_mode(tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> str | None:
    """The mode the template renders a prompt in when the row states none, given the run's
    kwargs: ``instant`` for a template without modes; None when its prompt matches neither."""
    run = dict(template_kwargs or {})
    probe = [{"role": "user", "content": "Hi."}]
    plain = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True, **run)
    thinking = render_prompt(tokenizer, probe, NO_TOOLS, "thinking", run)
    instant = render_prompt(tokenizer, probe, NO_TOOLS, "instant", run)
    if thinking == instant or plain == instant:
        return "instant"
    return "thinking" if plain == thinking else None


def classify(item: Item, default: str | None, template_kwargs: dict[str, Any]) -> tuple[str, str]:
    """(kind, mode) of a record: agent where it declares tools, else its mode; the mode is the
    row's own, else the run's default."""
    mode = item.mode or default
    if mode is None:
        raise PromptError(
            f"{item.where}: field 'mode': the row states no mode (thinking or instant) and the "
            f"target's template, given {template_kwargs or 'no kwargs'}, renders a prompt that "
            "is neither its thinking nor its instant one; state 'mode' in the row, or pass "
            "--chat-template-kwarg thinking=true|false"
        )
    return ("agent" if item.tools != NO_TOOLS else mode), mode


def _set_name(source: PromptSource, fmt: str, taken: set[str]) -> str:
    name = source.name or (fmt if fmt != "chat" else source.path.name.split(".")[0])
    if name in taken:
        raise PromptError(
            f"--prompts {source.path}: a second set named {name!r}; name each set (NAME=PATH)"
        )
    return name


def _spread(prompts: list[Prompt], limit: int | None) -> list[Prompt]:
    """A stable spread over the whole set, whatever the file order: by the hash of the id the
    file gives (without the set's name, which has no ':'), so a file selects the same prompts
    under any name. (The spread matters: on the tiny recipe two spreads of 40 held-out prompts
    measured AL 3.235 and 2.819 with one draft.)"""

    def file_key(p: Prompt) -> str:
        return hashlib.sha256(p.sample_id.partition(":")[2].encode()).hexdigest()

    prompts = sorted(prompts, key=file_key)
    return prompts if limit is None else prompts[:limit]


def build_prompt_set(
    selection: PromptSelection, tokenizer: Any, template_kwargs: dict[str, Any] | None = None
) -> PromptSet:
    """Every set of ``selection``: its first turns rendered, its later turns as follow-ups.
    ``limit`` and ``max_prompt_tokens`` apply per set to first turns (a question keeps its
    later turns)."""
    render = renderer(tokenizer, template_kwargs)
    default = default_mode(tokenizer, template_kwargs)
    prompts: list[Prompt] = []
    followups: list[FollowUp] = []
    sets: list[dict[str, Any]] = []
    for source in selection.sources:
        try:
            fmt, items = read_items(source.path)
        except PromptFileError as e:
            raise PromptError(str(e)) from e
        name = _set_name(source, fmt, {s["name"] for s in sets})
        rule = "a published benchmark file: held out by its publisher, not checked here"
        if fmt == "chat":
            items, rule = select(items, source.path, selection)
        first, too_long, later = [], 0, {}
        for item in items:
            sample_id = f"{name}:{item.key}"
            kind, mode = classify(item, default, template_kwargs or {})
            # A row stating neither mode nor tools renders with the run's kwargs, as before.
            stated = mode if item.mode is not None or item.tools != NO_TOOLS else None
            ids = render(item.messages, item.tools, stated)
            if len(ids) > selection.max_prompt_tokens:
                too_long += 1
                continue
            first.append(
                Prompt(
                    sample_id,
                    str(item.row.get("source", "")),
                    item.messages,
                    ids,
                    name,
                    item.category,
                    kind=kind,
                    tools=item.tools,
                    mode=stated,
                )
            )
            later[sample_id] = item.later_turns
        first = _spread(first, selection.limit)
        if not first:
            raise PromptError(f"{source.path}: no prompts left after selection ({rule})")
        for prompt in first:
            after = prompt.sample_id
            for turn, text in enumerate(later[prompt.sample_id], 2):
                followups.append(
                    FollowUp(
                        f"{prompt.sample_id}:turn-{turn}", after, text, name, prompt.category, turn
                    )
                )
                after = followups[-1].sample_id
        prompts += first
        categories = sorted({p.category for p in first if p.category is not None})
        sets.append(
            {
                "name": name,
                "format": fmt,
                "path": str(source.path),
                "file_fingerprint": fingerprint_file(source.path),
                "held_out_by": rule,
                "num_rows_selected": len(items),
                "num_too_long": too_long,
                "num_prompts": len(first) + sum(f.prompt_set == name for f in followups),
                "num_follow_up_turns": sum(f.prompt_set == name for f in followups),
                "categories": categories,
                "kinds": {k: sum(p.kind == k for p in first) for k in KINDS},
                "num_sources": len({source_file(p.source) for p in first if p.source}),
            }
        )
    ids = [p.sample_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise PromptError("duplicate sample ids in the prompt set")
    # What the engines saw: ids and token ids (chat template and tokenizer included), and
    # the later turns' text (their prompts hold the target's own answers, known only later).
    fingerprint = fingerprint_json(
        [{"id": p.sample_id, "prompt_token_ids": p.token_ids} for p in prompts]
        + [{"id": f.sample_id, "after": f.after, "user": f.user} for f in followups]
    )
    description = {
        "sets": sets,
        "held_out_by": "; ".join(f"{s['name']}: {s['held_out_by']}" for s in sets)
        if len(sets) > 1
        else sets[0]["held_out_by"],
        "default_mode": default,
        "kind_rule": "agent: the row declares tools; else thinking or instant: the row's "
        "'mode', else its 'kind', else thinking where a turn carries reasoning_content, else "
        "the template's default given the run's chat_template_kwargs",
        "max_prompt_tokens": selection.max_prompt_tokens,
        "limit": selection.limit,
        "num_prompts": len(prompts) + len(followups),
        "fingerprint": fingerprint,
    }
    return PromptSet(prompts, description, followups)


def follow_up_prompts(
    prompt_set: PromptSet,
    asked: Sequence[Prompt],
    answers: dict[str, list[int]],
    tokenizer: Any,
    render: Renderer,
) -> list[Prompt]:
    """The prompts of the follow-ups whose previous turn (one of ``asked``) has been answered:
    that turn's messages, the target's answer (decoded without special tokens, as a chat shows
    it) and the next user turn, rendered like every prompt."""
    known = {p.sample_id: p for p in asked}
    out = []
    for followup in prompt_set.followups:
        answer = answers.get(followup.after)
        if answer is None:
            continue
        before = known[followup.after]
        reply = tokenizer.decode(answer, skip_special_tokens=True).strip()
        messages = [
            *before.messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": followup.user},
        ]
        out.append(
            Prompt(
                followup.sample_id,
                before.source,
                messages,
                render(messages, before.tools, before.mode),
                followup.prompt_set,
                followup.category,
                followup.turn,
                before.kind,
                before.tools,
                before.mode,
            )
        )
    return out


def awaiting_answer(prompt_set: PromptSet, prompts: Sequence[Prompt]) -> list[str]:
    """Which of ``prompts`` a follow-up is asked after: their answers come first."""
    wanted = {f.after for f in prompt_set.followups}
    return [p.sample_id for p in prompts if p.sample_id in wanted]


def longest_follow_up(prompt_set: PromptSet, render: Renderer, max_new_tokens: int) -> int:
    """A bound on a follow-up prompt's tokens: its turns rendered around an answer of up to
    ``max_new_tokens`` per earlier turn (an answer decoded and encoded again can change its
    token count a little: twice the tokens is the room given)."""
    first = {p.sample_id: p for p in prompt_set.prompts}
    longest = 0
    messages: dict[str, list[dict[str, Any]]] = {k: p.messages for k, p in first.items()}
    asked: dict[str, Prompt] = dict(first)
    for followup in prompt_set.followups:
        messages[followup.sample_id] = [
            *messages[followup.after],
            {"role": "assistant", "content": ""},
            {"role": "user", "content": followup.user},
        ]
        before = asked[followup.sample_id] = asked[followup.after]
        rendered = render(messages[followup.sample_id], before.tools, before.mode)
        answers = followup.turn - 1
        longest = max(longest, len(rendered) + 2 * answers * max_new_tokens)
    return longest
