"""Chat examples made from the standard library's functions, as conversations the server
would render.

Two kinds:
- docstring: the user asks for a function (its docstring as the request, or its signature)
  and the assistant answers with the function's source, as plain text.
- tools: the system prompt describes one to four tools made from functions (name, the
  docstring's first sentence, a JSON schema of the parameters), the user asks for a call with
  some values, the assistant calls the tool (`<tool_call>` with JSON arguments), the tool
  answers, the assistant gives a final answer.

Messages are dicts as the server hands them to the chat template (`Message.for_template()`:
role, content, `tool_calls` with JSON-string arguments, `tool_call_id`) and tools as it
dumps them (`{"type": "function", "function": {name, description, parameters}}`), so a
rendered example is what the server renders for the same conversation, and a prompt is that
rendering cut where the assistant's turn begins.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..model.template import ChatTemplate
from .sources import Function

# an answer longer than this is no demonstration a 256-token reply could follow
MAX_ANSWER_CHARS = 1600
# evaluation prompts: functions whose source fits well within 256 tokens
MAX_EVAL_ANSWER_CHARS = 700
MAX_TOOL_PARAMS = 4

_SYSTEMS = ("You are a helpful assistant.", "You are a coding assistant.",
            "You are a helpful assistant with access to tools. Call a tool when it helps.")
_WORDS = ("hello world", "utf-8", "example.txt", "/tmp/data", "alpha", "beta", "spam", "eggs",
          "README.md", "localhost", "main", "x", "key", "value", "a,b,c", "2024-01-31",
          "text/plain", "ascii", "python", "error", "12", "\t", "name", "foo.bar")


class Example(NamedTuple):
    """A conversation; `tools` None when it has none. For an evaluation item, `messages`
    ends with the user's request and `reference` is what the training data would answer."""

    kind: str                  # "docstring" | "tools"
    messages: list[dict]
    tools: list[dict] | None
    reference: str = ""


def render(template: ChatTemplate, example: Example) -> str:
    """The whole conversation as training text, as the server renders its history."""
    return template.render(example.messages, tools=example.tools)


def render_prompt(template: ChatTemplate, example: Example) -> str:
    """The prompt of an evaluation item (messages up to the user's request), with the
    generation prompt and the template's default thinking, as the server renders it."""
    return template.render(example.messages, tools=example.tools, add_generation_prompt=True)


# --- docstring examples ----------------------------------------------------------------------

def first_sentence(docstring: str) -> str:
    """The docstring's first paragraph, on one line, up to its first full stop."""
    para = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?[.!?])(\s|$)", para)
    return match.group(1) if match else para


def _asked_by_docstring(fn: Function, rng: random.Random) -> str:
    if rng.random() < 0.5:
        return f"{fn.docstring}\n\nWrite this as a Python function named `{fn.name}`."
    return f"Write a Python function `{fn.name}{fn.signature}` that does this:\n\n" \
           f"{fn.docstring}"


def docstring_request(fn: Function, rng: random.Random) -> str:
    """The user's request for `fn`: its docstring, or (without one, or at times) its
    signature."""
    if fn.docstring and rng.random() < 0.8:
        return _asked_by_docstring(fn, rng)
    return f"Implement `def {fn.name}{fn.signature}:` in Python."


def docstring_example(fn: Function, rng: random.Random) -> Example:
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
    messages.append({"role": "user", "content": docstring_request(fn, rng)})
    messages.append({"role": "assistant", "content": fn.source})
    return Example("docstring", messages, None, fn.source)


def docstring_prompt(fn: Function, rng: random.Random) -> Example:
    """An evaluation item: the docstring as the request (no system prompt)."""
    return Example("docstring", [{"role": "user", "content": _asked_by_docstring(fn, rng)}],
                   None, fn.source)


def answerable(fn: Function, limit: int = MAX_ANSWER_CHARS) -> bool:
    return len(fn.source) <= limit


# --- tool examples ---------------------------------------------------------------------------

def usable_as_tool(fn: Function) -> bool:
    """A public function with a docstring and one to four plain parameters."""
    return (fn.docstring is not None and fn.simple and not fn.name.startswith("_")
            and 1 <= len(fn.params) <= MAX_TOOL_PARAMS and len(fn.name) <= 64)


def tool_schema(fn: Function) -> dict:
    """The tool as the server dumps a request's `tools` entry."""
    return {"type": "function", "function": {
        "name": fn.name, "description": first_sentence(fn.docstring or ""),
        "parameters": {"type": "object",
                       "properties": {p.name: {"type": p.json_type} for p in fn.params},
                       "required": [p.name for p in fn.params if p.required]}}}


_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
_SHAPES = ("{}", "{}", "{}_{}", "{}.txt", "/tmp/{}", "{} {}", "{}-{}", "{}.{}")


def _made_word(rng: random.Random) -> str:
    """A string no corpus text predicts (made-up words in a few shapes): a reply can only
    get it right by copying it from the request, the skill tool calls need for names."""
    shape = rng.choice(_SHAPES)
    words = ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
             for _ in range(shape.count("{}"))]
    return shape.format(*words)


def _string(rng: random.Random) -> str:
    return rng.choice(_WORDS) if rng.random() < 0.3 else _made_word(rng)


def _value(json_type: str, rng: random.Random) -> Any:
    if json_type == "integer":
        return rng.choice((rng.randint(0, 10), rng.randint(-100, 1000)))
    if json_type == "number":
        return round(rng.uniform(-100, 100), rng.randint(1, 3))
    if json_type == "boolean":
        return rng.random() < 0.5
    if json_type == "array":
        return [rng.randint(0, 99) for _ in range(rng.randint(1, 3))]
    if json_type == "object":
        return {rng.choice(("key", "name", "id")): rng.randint(0, 99)}
    return _string(rng)


def _arguments(fn: Function, rng: random.Random) -> dict:
    """Every required parameter and a few optional ones, with values of their types."""
    chosen = [p for p in fn.params if p.required or rng.random() < 0.3]
    return {p.name: _value(p.json_type, rng) for p in chosen}


def _spoken(arguments: dict, rng: random.Random) -> str:
    """The arguments as a user might write them."""
    style = rng.randrange(3)
    parts = []
    for name, value in arguments.items():
        text = json.dumps(value, ensure_ascii=False)
        if style == 0:
            parts.append(f"{name}={text}")
        elif style == 1:
            parts.append(f"{name} set to {text}")
        else:
            parts.append(f"`{name}` = {text}")
    return ", ".join(parts) if parts else "no arguments"


def _request(fn: Function, arguments: dict, rng: random.Random) -> str:
    summary = first_sentence(fn.docstring or "").rstrip(".")
    spoken = _spoken(arguments, rng)
    return rng.choice((
        f"{summary}. Use {spoken}.",
        f"Please call {fn.name} with {spoken}.",
        f"I need this: {summary[:1].lower() + summary[1:]} ({spoken}).",
        f"Can you run {fn.name} for me? {spoken[:1].upper() + spoken[1:]}.",
    ))


def _result(rng: random.Random) -> str:
    return json.dumps(rng.choice((rng.randint(-50, 5000), rng.choice(_WORDS), True, False,
                                  None, [rng.randint(0, 9) for _ in range(3)])))


def tool_example(target: Function, others: Sequence[Function], rng: random.Random,
                 *, complete: bool = True) -> Example:
    """A conversation calling `target` among `others` (listed too, in a random order). With
    `complete` false it ends at the user's request (an evaluation item) and `reference` is
    the call the training data would make."""
    listed = [*others, target]
    rng.shuffle(listed)
    tools = [tool_schema(f) for f in listed]
    arguments = _arguments(target, rng)
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": rng.choice(_SYSTEMS)})
    messages.append({"role": "user", "content": _request(target, arguments, rng)})
    call = json.dumps({"name": target.name, "arguments": arguments}, ensure_ascii=False)
    if not complete:
        return Example("tools", messages, tools, call)
    result = _result(rng)
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{rng.randrange(10**8):08d}", "type": "function",
            "function": {"name": target.name,
                         "arguments": json.dumps(arguments, ensure_ascii=False)}}]},
        {"role": "tool", "content": result},
        {"role": "assistant", "content": rng.choice((
            f"{target.name} returned {result}.", f"The result is {result}.",
            f"Done: the call gave {result}."))},
    ]
    return Example("tools", messages, tools, call)


def _made_identifier(rng: random.Random, words: int,
                     pieces: Sequence[str] | None = None) -> str:
    """`words` parts joined by "_": made-up syllables, or with `pieces` real identifiers'
    parts (joined with "_" or nothing), so the name looks like one a model has read."""
    if pieces:
        return rng.choice(("_", "")).join(rng.choice(pieces) for _ in range(words))
    return "_".join("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3)))
                    for _ in range(words))


def name_pieces(functions: Sequence[Function]) -> tuple[str, ...]:
    """The parts of the functions' and their parameters' names (split at "_"), each
    once, sorted: what `renamed` recombines with `pieces`."""
    names = {fn.name for fn in functions} | {p.name for fn in functions for p in fn.params}
    return tuple(sorted({part for name in names for part in name.split("_") if part}))


def renamed(functions: Sequence[Function], rng: random.Random,
            pieces: Sequence[str] | None = None) -> list[Function]:
    """The functions with made-up names, and parameters of made-up names (distinct within
    each, and the functions' names distinct): what they do (the docstring) and their
    parameters' types kept. A call to one is right only if its names were copied from the
    tools listed: no name learnt by heart helps. With `pieces` (`name_pieces`) the names
    recombine real names' parts ("month_lines", "getquota"), where the language's prior
    for how a familiar name goes on is wrong: made-up syllables never tempt a model to
    finish a name its own way, which is how the trained model miscopied real ones
    ("monthdayscalendar" as "monthdayscalm", bench/NOTES.md, stop 41). A recombined name
    that is one of these functions' real names is drawn on."""
    real = {fn.name for fn in functions} | {p.name for fn in functions for p in fn.params}
    # with pieces, a recombined real name is as bad as a name already taken
    barred = real if pieces else set()

    def fresh(words: int, taken: set[str]) -> str:
        name = _made_identifier(rng, words, pieces)
        while name in taken or name in barred:
            name += rng.choice(_SYLLABLES) if not pieces else "_" + rng.choice(pieces)
        taken.add(name)
        return name

    out, names = [], set()
    for fn in functions:
        name = fresh(rng.randint(1, 2) if not pieces else 2, names)
        used: set[str] = set()
        params = tuple(p._replace(name=fresh(1, used)) for p in fn.params)
        out.append(fn._replace(name=name, qualname=name, params=params))
    return out


def tool_examples(pool: Sequence[Function], count: int, rng: random.Random,
                  *, complete: bool = True, made_up: float = 0.0,
                  naming: random.Random | None = None,
                  pieces: Sequence[str] | None = None, near: float = 0.0,
                  nearby: random.Random | None = None) -> list[Example]:
    """`count` tool conversations over `pool`: each function in turn as the target (the
    pool shuffled, then cycled), with up to three other functions of distinct names; in a
    share `made_up` of them every listed function is `renamed` (from `pieces` when given).
    Which ones, and their new names, are drawn from `naming` (default: seeded with 0),
    never from `rng`: the other draws, the held-out prompts' after them included, are
    those of `made_up` 0. In a share `near` of them the other functions come from the
    target's own module, as many as it has (methods of one class, functions of one
    topic: descriptions alike, so the call must follow the request's words), drawn from
    `nearby` (default: seeded with 0), never from `rng`, as with `naming`."""
    naming = naming or random.Random(0)
    nearby = nearby or random.Random(0)
    order = list(pool)
    rng.shuffle(order)
    by_module: dict[str, list[Function]] = {}
    for fn in order:
        by_module.setdefault(fn.module, []).append(fn)
    out = []
    for i in range(count):
        target = order[i % len(order)]
        names, others, wanted = {target.name}, [], rng.randint(0, 3)
        for other in rng.sample(order, min(len(order), 6)):
            if len(others) < wanted and other.name not in names:
                others.append(other)
                names.add(other.name)
        if near and others and nearby.random() < near:
            others = _neighbours(target, others, by_module[target.module], nearby)
        if made_up and naming.random() < made_up:
            target, *others = renamed([target, *others], naming, pieces)
        out.append(tool_example(target, others, rng, complete=complete))
    return out


def _neighbours(target: Function, others: list[Function], module: Sequence[Function],
                rng: random.Random) -> list[Function]:
    """As many other functions as `others`, of distinct names, from the target's module
    first (in a random order), the rest kept from `others`."""
    names, picked = {target.name}, []
    for fn in rng.sample(module, len(module)):
        if len(picked) < len(others) and fn.name not in names:
            picked.append(fn)
            names.add(fn.name)
    for fn in others:
        if len(picked) < len(others) and fn.name not in names:
            picked.append(fn)
            names.add(fn.name)
    return picked
