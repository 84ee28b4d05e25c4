"""The agent target's corpus: Kimi-K2.5's three kinds of traffic, made by a seeded program.

    PYTHONPATH=tests uv run python -m support.agent_corpus OUT.jsonl [--conversations N] [--seed S]

Issue 43 needs a small target that thinks and calls tools, so a draft can be measured on each
kind of traffic a Kimi user serves. Its corpus is generated here, from the seed alone: no file
of this machine is read, so the corpus is the same on every Python (the tiny corpus reads the
stdlib, which differs between versions and once broke a held-out proof on the GPU image).

A shop of seeded items is the world. Three tools act on it and the program computes each result:
``get_price(item)``, ``get_stock(item)`` and ``calculate(expression)`` (integers; + - * and
parentheses). Rows are OpenAI-style conversations, as ``eagle3-data ingest`` reads them:

- ``instant``: no tools, no reasoning; a sum, a product, a word spelt backwards, numbers sorted.
- ``thinking``: a word problem; ``reasoning_content`` works it out step by step, the answer follows.
- ``agent``: tools declared; the assistant reasons, calls one or two tools (two calls in one turn
  for two items), reads their results and answers; a third of these continue with a second user
  turn and another call (a multi-turn loop), and one in five answers without reasoning (Kimi's
  instant mode with tools).

Tool-call ids follow Kimi's form ``functions.NAME:INDEX`` (INDEX counts the conversation's
calls), which vLLM's ``kimi_k2`` tool parser reads. Each row carries ``kind``, ``split``
(``heldout`` for ~5 % of each kind, by the hash of the row's content) and ``source``.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("instant", "thinking", "agent")
HELDOUT_PERCENT = 5
DEFAULT_CONVERSATIONS = 4000
DEFAULT_SEED = 0

ADJECTIVES = ("red", "blue", "green", "small", "large", "steel", "wooden", "glass", "paper",
              "silver", "round", "square", "soft", "heavy", "light", "black", "white", "golden")  # fmt: skip
NOUNS = ("kettle", "lamp", "chair", "notebook", "bottle", "basket", "clock", "mirror", "pencil",
         "blanket", "bowl", "candle", "hammer", "jacket", "ladder", "pillow", "spoon", "teapot")  # fmt: skip
WORDS = ("garden", "planet", "window", "silver", "rocket", "bridge", "forest", "yellow", "marble",
         "castle", "pepper", "violin", "harbor", "meadow", "puzzle", "tunnel", "lantern", "orbit")  # fmt: skip

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "get_price", "description": "The unit price of an item in the shop, in euros.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                       "required": ["item"]}}},
    {"type": "function", "function": {
        "name": "get_stock", "description": "How many units of an item the shop has in stock.",
        "parameters": {"type": "object", "properties": {"item": {"type": "string"}},
                       "required": ["item"]}}},
    {"type": "function", "function": {
        "name": "calculate", "description": "Evaluate an integer arithmetic expression (+, -, *, parentheses).",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}},
]  # fmt: skip
TOOL_NAMES = frozenset(t["function"]["name"] for t in TOOLS)


@dataclass(frozen=True)
class Item:
    name: str
    price_cents: int
    stock: int

    @property
    def price(self) -> str:
        return f"{self.price_cents // 100}.{self.price_cents % 100:02d}"


def shop(seed: int) -> dict[str, Item]:
    """Every adjective-noun pair as an item with a seeded price (0.50-99.99 EUR) and stock."""
    rng = random.Random(f"shop-{seed}")
    names = [f"{a} {n}" for a in ADJECTIVES for n in NOUNS]
    return {n: Item(n, rng.randint(50, 9999), rng.randint(0, 250)) for n in names}


_OPERATORS: dict[type, Callable[[int, int], int]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
}


def calculate(expression: str) -> int:
    """The calculator tool: integers, + - * and parentheses only (anything else is refused)."""

    def value(node: ast.expr) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"calculate: not an integer expression of + - * ( ): {expression!r}")

    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError:
        raise ValueError(
            f"calculate: not an integer expression of + - * ( ): {expression!r}"
        ) from None
    return value(tree.body)


def money(cents: int) -> str:
    return f"{cents // 100}.{cents % 100:02d}"


class _Calls:
    """Kimi's call ids, numbered over the conversation: functions.NAME:INDEX."""

    def __init__(self) -> None:
        self.count = 0

    def call(self, name: str, **arguments: object) -> dict[str, Any]:
        call_id = f"functions.{name}:{self.count}"
        self.count += 1
        text = json.dumps(arguments, ensure_ascii=False)
        return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def tool_result(world: dict[str, Item], call: dict[str, Any]) -> dict[str, Any]:
    """The tool turn answering ``call``, computed from the world."""
    name = call["function"]["name"]
    args = json.loads(call["function"]["arguments"])
    if name == "get_price":
        result: dict[str, Any] = {"item": args["item"], "price": world[args["item"]].price,
                                  "currency": "EUR"}  # fmt: skip
    elif name == "get_stock":
        result = {"item": args["item"], "in_stock": world[args["item"]].stock}
    elif name == "calculate":
        result = {"result": calculate(args["expression"])}
    else:
        raise ValueError(f"unknown tool {name!r}")
    content = json.dumps(result, ensure_ascii=False)
    return {"role": "tool", "tool_call_id": call["id"], "name": name, "content": content}


def _assistant(content: str, reasoning: str | None = None, calls: Sequence[dict] = ()) -> dict:
    turn: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        turn["reasoning_content"] = reasoning
    if calls:
        turn["tool_calls"] = list(calls)
    return turn


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


# ---- instant ------------------------------------------------------------------------------


def instant(rng: random.Random, world: dict[str, Item]) -> list[dict[str, Any]]:
    task = rng.randrange(4)
    if task == 0:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        return [_user(f"What is {a} + {b}?"), _assistant(f"{a} + {b} = {a + b}.")]
    if task == 1:
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        return [_user(f"Multiply {a} by {b}."), _assistant(f"{a} × {b} = {a * b}.")]
    if task == 2:
        word = rng.choice(WORDS)
        return [_user(f"Spell '{word}' backwards."), _assistant(f"'{word}' backwards is '{word[::-1]}'.")]  # fmt: skip
    numbers = rng.sample(range(1, 100), rng.randint(3, 6))
    listed = ", ".join(map(str, numbers))
    ordered = ", ".join(map(str, sorted(numbers)))
    return [_user(f"Sort these numbers from smallest to largest: {listed}."), _assistant(ordered + ".")]  # fmt: skip


# ---- thinking -----------------------------------------------------------------------------


def thinking(rng: random.Random, world: dict[str, Item]) -> list[dict[str, Any]]:
    noun = rng.choice(NOUNS)
    per_box, boxes, loose = rng.randint(3, 24), rng.randint(2, 30), rng.randint(1, 20)
    total = per_box * boxes + loose
    if rng.random() < 0.5:
        question = (f"A box holds {per_box} {noun}s. How many {noun}s are there in {boxes} boxes "
                    f"and {loose} loose {noun}s?")  # fmt: skip
        reasoning = (f"Each box holds {per_box} {noun}s, so {boxes} boxes hold {boxes} × {per_box} "
                     f"= {per_box * boxes}. Adding the {loose} loose ones gives "
                     f"{per_box * boxes} + {loose} = {total}.")  # fmt: skip
        return [_user(question), _assistant(f"There are {total} {noun}s.", reasoning)]
    sold = rng.randint(1, total)
    question = (f"A shop had {boxes} boxes of {per_box} {noun}s and {loose} loose {noun}s. It sold "
                f"{sold}. How many are left?")  # fmt: skip
    reasoning = (f"The boxes hold {boxes} × {per_box} = {per_box * boxes} {noun}s; with the {loose} "
                 f"loose ones that is {per_box * boxes} + {loose} = {total}. After selling {sold}, "
                 f"{total} - {sold} = {total - sold} are left.")  # fmt: skip
    return [_user(question), _assistant(f"{total - sold} {noun}s are left.", reasoning)]


# ---- agent --------------------------------------------------------------------------------


def agent(rng: random.Random, world: dict[str, Item]) -> list[dict[str, Any]]:
    """A tool loop; one in five without reasoning (instant mode), a third with a follow-up."""
    think = rng.random() >= 0.2
    calls = _Calls()
    names = list(world)
    task = rng.randrange(3)
    item = world[rng.choice(names)]
    messages: list[dict[str, Any]] = []

    def step(reasoning: str, content: str, made: Sequence[dict[str, Any]]) -> None:
        messages.append(_assistant(content, reasoning if think else None, made))
        messages.extend(tool_result(world, c) for c in made)

    if task == 0:  # one price, then a product through the calculator
        count = rng.randint(2, 12)
        messages.append(_user(f"How much do {count} {item.name}s cost?"))
        price = calls.call("get_price", item=item.name)
        step(f"I need the unit price of the {item.name}.", "", [price])
        expression = f"{count} * {item.price_cents}"
        calc = calls.call("calculate", expression=expression)
        step(f"One {item.name} costs {item.price} EUR, which is {item.price_cents} cents; I will "
             f"multiply by {count}.", "", [calc])  # fmt: skip
        total = count * item.price_cents
        messages.append(_assistant(
            f"{count} {item.name}s cost {money(total)} EUR.",
            f"{count} × {item.price_cents} cents = {total} cents, that is {money(total)} EUR."
            if think else None))  # fmt: skip
    elif task == 1:  # stock against an order
        wanted = rng.randint(1, 200)
        messages.append(_user(f"Can I order {wanted} {item.name}s?"))
        step(f"I should check the stock of the {item.name}.", "",
             [calls.call("get_stock", item=item.name)])  # fmt: skip
        enough = item.stock >= wanted
        answer = (f"Yes: {item.stock} are in stock, enough for {wanted}." if enough
                  else f"No: only {item.stock} are in stock, {wanted - item.stock} short of {wanted}.")  # fmt: skip
        messages.append(
            _assistant(answer, f"{item.stock} in stock against {wanted} wanted." if think else None)
        )
    else:  # two prices in one turn (two calls), then which is cheaper
        other = world[rng.choice([n for n in names if n != item.name])]
        messages.append(_user(f"Which is cheaper, the {item.name} or the {other.name}?"))
        step("I need both prices; I can ask for them at once.", "",
             [calls.call("get_price", item=item.name), calls.call("get_price", item=other.name)])  # fmt: skip
        cheap, dear = sorted((item, other), key=lambda i: (i.price_cents, i.name))
        if cheap.price_cents == dear.price_cents:
            answer = f"They cost the same: {cheap.price} EUR each."
        else:
            answer = (f"The {cheap.name} is cheaper: {cheap.price} EUR against {dear.price} EUR "
                      f"for the {dear.name}.")  # fmt: skip
        messages.append(
            _assistant(
                answer, f"{cheap.price} EUR is less than {dear.price} EUR." if think else None
            )
        )
    if rng.random() < 1 / 3:  # the loop goes on: a second question, another call
        follow = world[rng.choice(names)]
        messages.append(_user(f"And how many {follow.name}s do you have?"))
        step(f"Another stock look-up, for the {follow.name}.", "",
             [calls.call("get_stock", item=follow.name)])  # fmt: skip
        messages.append(
            _assistant(
                f"We have {follow.stock} {follow.name}s in stock.",
                f"The shop reports {follow.stock}." if think else None,
            )
        )
    return messages


MAKERS: dict[str, Callable[[random.Random, dict[str, Item]], list[dict[str, Any]]]] = {
    "instant": instant,
    "thinking": thinking,
    "agent": agent,
}
SHARES = {"instant": 0.3, "thinking": 0.3, "agent": 0.4}


def split_of(row: dict[str, Any]) -> str:
    """Held out by the hash of the conversation's content (stable on every machine)."""
    text = json.dumps(row["messages"], sort_keys=True, ensure_ascii=False).encode()
    bucket = int.from_bytes(hashlib.sha256(text).digest()[:8], "big") % 100
    return "heldout" if bucket < HELDOUT_PERCENT else "train"


def build_agent_corpus(
    conversations: int = DEFAULT_CONVERSATIONS, seed: int = DEFAULT_SEED
) -> list[dict[str, Any]]:
    """``conversations`` rows in SHARES' proportions, deduplicated by content, in a seeded order."""
    world = shop(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for kind in KINDS:
        rng = random.Random(f"{kind}-{seed}")
        wanted = round(conversations * SHARES[kind])
        made = 0
        while made < wanted:
            messages = MAKERS[kind](rng, world)
            key = json.dumps(messages, sort_keys=True, ensure_ascii=False)
            if key in seen:
                continue
            seen.add(key)
            row: dict[str, Any] = {"messages": messages, "kind": kind,
                                   "source": f"agent_corpus/{kind}/{made:05d}"}  # fmt: skip
            if kind == "agent":
                row["tools"] = TOOLS
            row["split"] = split_of(row)
            rows.append(row)
            made += 1
    random.Random(f"order-{seed}").shuffle(rows)
    return rows


def corpus_fingerprint(rows: Sequence[dict[str, Any]]) -> str:
    """sha256 over every row in corpus order (what a target's build_info records)."""
    h = hashlib.sha256()
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return "sha256:" + h.hexdigest()


def write_agent_corpus_jsonl(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Written to a temporary name, then renamed: a cut-short write never looks whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with partial.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    partial.replace(path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSONL file to write")
    parser.add_argument("--conversations", type=int, default=DEFAULT_CONVERSATIONS)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    rows = build_agent_corpus(args.conversations, args.seed)
    write_agent_corpus_jsonl(rows, args.out)
    counts = {k: sum(r["kind"] == k for r in rows) for k in KINDS}
    heldout = {k: sum(r["kind"] == k and r["split"] == "heldout" for r in rows) for k in KINDS}
    print(f"wrote {len(rows)} conversations to {args.out}: {counts}, held out {heldout}; "
          f"{corpus_fingerprint(rows)}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
