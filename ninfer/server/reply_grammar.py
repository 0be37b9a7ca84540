"""The grammar a reply is held to, built from what a request asks for: an answer in a format
(a JSON schema, any JSON object, a regular expression, one of some strings, a Lark grammar),
tool calls in the model's own markup, or either. The result is llguidance's grammar text,
which the engine compiles for the model's tokenizer (ninfer/engine/grammar.py).

`reply_grammar(answer, calls, after_reasoning=...)` is the one entry point: every API's
adapter converts its own fields (chat's `response_format`, vLLM's `structured_outputs`, the
Responses API's `text.format`, Anthropic's `output_config.format`, a forced tool choice) to
an `OutputFormat` and / or `ToolCalls` and calls it.

The reply is written so that the chat template renders it back identically (a
conversation's next turn then reuses its state): after a reasoning block the answer starts
with the blank line the template puts there; tool calls are Qwen's
`<tool_call>\\n{"name": "NAME", "arguments": ARGS}\\n</tool_call>`, one newline apart, with
text before them only when a newline separates it; nothing follows the last call.

Other formats allow any JSON whitespace, at most 32 characters of it at each place; strict
formats (`strict: true`) have no free whitespace (`", "` and `": "` separate items
and keys, nothing else) and bounded numbers: a number without bounds stays within
±(10^15 - 1), and a non-integer one has at most 6 decimals (`multipleOf` 1e-6), so a
complete document of a bounded schema has a bounded length (`document_bound`).

A tool with an input grammar (a Responses API `custom` tool with a `grammar` format) is
called as `{"input": "TEXT"}`, TEXT the JSON escaping of a sentence of that grammar
(quoted_grammar.py), in every tool choice mode.
"""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any, Literal, NamedTuple

import llguidance

from .parsing import ANSWER_GAP, CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN
from .quoted_grammar import quoted_lark, quoted_regex

Kind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
NUMBER_LIMIT = 10**15 - 1      # strict: the bound of a number without one
DECIMALS = 6                   # strict: the decimals of a number without `multipleOf`
STRICT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# not strict: any JSON whitespace, but a bounded run of it at each place (a model may
# otherwise degenerate into whitespace for ever: the known failure of free JSON whitespace)
LOOSE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,32}"}
# free text before tool calls: anything but the tags the output parser acts on (written as
# text, not as their tokens, they would still be read as markup)
_NO_TAGS = "~/(?s:.*)(" + "|".join(t.replace("/", "\\/") for t in (CALL_OPEN, THINK_OPEN,
                                                                     THINK_CLOSE)) + ")(?s:.*)/"


class OutputFormat(NamedTuple):
    """An answer's format. `spec`: the JSON schema (a dict) for json_schema, the pattern
    for regex, the strings for choice, the grammar's text for lark; unused for
    json_object."""

    kind: Kind
    spec: Any = None
    strict: bool = False


class InputGrammar(NamedTuple):
    """A custom tool's input: one string parameter, its text held to a grammar (`syntax`
    "lark" or "regex") written inside the JSON string (quoted_grammar.py)."""

    syntax: Literal["lark", "regex"]
    definition: str
    parameter: str = "input"

    def quoted(self) -> dict[str, Any]:
        """The sub-grammar of the parameter's escaped text."""
        if self.syntax == "regex":
            return {"lark_grammar": "start: " + quoted_regex(self.definition)}
        return {"lark_grammar": quoted_lark(self.definition)}


class ToolFormat(NamedTuple):
    """A tool the model may call: its arguments' JSON schema (None: any object); `strict`
    holds them to it exactly (strict formatting, see the module). A tool with an `input`
    grammar is called with that one parameter, held to the grammar whatever the mode."""

    name: str
    parameters: dict[str, Any] | None = None
    strict: bool = False
    input: InputGrammar | None = None

    @property
    def held(self) -> bool:
        """Whether a call's arguments are constrained in "auto" mode too."""
        return self.strict or self.input is not None


class ToolCalls(NamedTuple):
    """How the reply calls tools. `mode`: "required" (one call or more, nothing else),
    "named" (one call of `tools[0]`, nothing else) or "auto" (text, then calls if any; only
    strict tools' arguments are held to their schemas). `parallel`: more than one call."""

    tools: tuple[ToolFormat, ...]
    mode: Literal["auto", "required", "named"] = "auto"
    parallel: bool = True


def reply_grammar(answer: OutputFormat | None = None, calls: ToolCalls | None = None, *,
                  after_reasoning: bool = False) -> str | None:
    """The llguidance grammar text of a reply with `answer` or `calls` (or either, when
    both are given and tool choice is "auto"); None when nothing constrains the reply (no
    answer format, tool choice "auto" with no strict tool). `after_reasoning`: the grammar
    starts right after the reasoning block (its end token), where the template puts a blank
    line. Raises ValueError naming what is wrong (a grammar that fails to compile is the
    compiler's to report)."""
    subgrammars: list[dict[str, Any]] = []
    rules = []
    body = []
    if calls is not None and calls.mode != "auto" and answer is not None:
        raise ValueError("a forced tool call leaves no room for a response format")
    if answer is not None:
        body.append(_answer(answer, subgrammars))
    if calls is not None:
        if calls.mode == "auto" and answer is None:
            if not any(t.held for t in calls.tools):
                return None
            rules.append("TEXT: /(?s:.+)/ & " + _NO_TAGS)
            rules.append("LEAD: /(?s:.+)\\n/ & " + _NO_TAGS)
            body += ["TEXT", "LEAD calls", "calls"]
        else:
            body.append("calls")
        rules += _calls(calls, subgrammars)
    if not body:
        return None
    start = " | ".join(body)
    top = (f"start: {json.dumps(ANSWER_GAP)} ({start})" if after_reasoning
           else f"start: {start}")
    return json.dumps({"grammars": [{"lark_grammar": "\n".join([top, *rules])}, *subgrammars]},
                      ensure_ascii=False)


def _answer(fmt: OutputFormat, subgrammars: list[dict]) -> str:
    """The rule (or terminal) an answer in `fmt` is; sub-grammars appended."""
    if fmt.kind in ("json_schema", "json_object"):
        schema = {"type": "object"} if fmt.kind == "json_object" else fmt.spec
        return _subgrammar(subgrammars, "answer", json_grammar(schema, fmt.strict))
    if fmt.kind == "regex":
        if not isinstance(fmt.spec, str):
            raise ValueError("a regex format needs a pattern (a string)")
        return f"/{llguidance.regex_to_lark(fmt.spec)}/"
    if fmt.kind == "choice":
        if not fmt.spec or not all(isinstance(c, str) for c in fmt.spec):
            raise ValueError("a choice format needs a non-empty list of strings")
        return "(" + " | ".join(json.dumps(c, ensure_ascii=False) for c in fmt.spec) + ")"
    if fmt.kind == "lark":
        if not isinstance(fmt.spec, str) or not fmt.spec.strip():
            raise ValueError("a grammar format needs the grammar's text")
        return _subgrammar(subgrammars, "answer", {"lark_grammar": fmt.spec})
    raise ValueError(f"unknown output format {fmt.kind!r}")


def _calls(calls: ToolCalls, subgrammars: list[dict]) -> list[str]:
    """The rules of one tool call or several, in the template's markup."""
    if not calls.tools:
        raise ValueError("tool calls need tools")
    tools = calls.tools[:1] if calls.mode == "named" else calls.tools
    alternatives = []
    for i, tool in enumerate(tools):
        if tool.input is not None:
            text = _subgrammar(subgrammars, f"input_{i}", tool.input.quoted())
            opening = json.dumps(f'{{{json.dumps(tool.input.parameter)}: "')
            args = f'{opening} {text} "\\"}}"'
        else:
            if calls.mode == "auto" and not tool.strict:
                arguments = {"type": "object"}   # not held to its schema: any object
            else:
                arguments = _object_schema(tool)
            args = _subgrammar(subgrammars, f"arguments_{i}",
                               json_grammar(arguments, tool.strict))
        head = json.dumps(f'\n{{"name": {json.dumps(tool.name)}, "arguments": ')
        # the tags are the tokenizer's own tokens (Lark's <token> syntax), as the model
        # writes them
        alternatives.append(f'{CALL_OPEN} {head} {args} "}}\\n" {CALL_CLOSE}')
    repeat = calls.parallel and calls.mode != "named"
    return ['calls: call ("\\n" call)*' if repeat else "calls: call",
            "call: " + " | ".join(alternatives)]


def _object_schema(tool: ToolFormat) -> dict[str, Any]:
    schema = dict(tool.parameters) if tool.parameters else {"type": "object"}
    kind = schema.setdefault("type", "object")
    if kind != "object":
        raise ValueError(f"tool {tool.name!r}: its parameters must be an object schema")
    return schema


def _subgrammar(subgrammars: list[dict], name: str, grammar: dict[str, Any]) -> str:
    subgrammars.append({"name": name, **grammar})
    return f"@{name}"


def json_grammar(schema: Any, strict: bool) -> dict[str, Any]:
    """A JSON schema as an llguidance sub-grammar: strict formatting and bounded numbers
    when `strict`, any whitespace otherwise."""
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be an object")
    shaped = bounded_numbers(schema) if strict else dict(schema)
    shaped["x-guidance"] = STRICT if strict else LOOSE   # ours, whatever the client sent
    return {"json_schema": shaped}


# --- strict numbers and document bounds ---------------------------------------------------

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def bounded_numbers(schema: Any) -> Any:
    """`schema` with every number and integer bounded (±NUMBER_LIMIT where it sets no
    bound) and every non-integer number a multiple of 10^-DECIMALS where it sets no
    `multipleOf`; the rest unchanged."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [bounded_numbers(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: bounded_numbers(s) for k, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = bounded_numbers(out[key])
    types = out.get("type")
    types = set(types) if isinstance(types, list) else {types}
    if types & {"number", "integer"}:
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -NUMBER_LIMIT
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = NUMBER_LIMIT
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{DECIMALS}")
    return out


def document_bound(schema: Any) -> int | None:
    """At most how many bytes a complete document of `schema` has when written strictly
    (bounded_numbers applied, no free whitespace), or None when the schema does not bound it
    (a string without maxLength, an array without maxItems, an object open to other keys, a
    $ref). Every token is at least a byte, so it bounds the tokens too (plus the end token).
    """
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return _value_bound(schema["const"])
    if "enum" in schema:
        bounds = [_value_bound(v) for v in schema["enum"]]
        return max(bounds) if bounds else None
    if "$ref" in schema:
        return None
    if "anyOf" in schema or "oneOf" in schema:
        bounds = [document_bound(s) for s in schema.get("anyOf", schema.get("oneOf", []))]
        return None if not bounds or None in bounds else max(bounds)
    if "allOf" in schema:
        bounds = [b for b in (document_bound(s) for s in schema["allOf"]) if b is not None]
        return min(bounds) if bounds else None
    types = schema.get("type")
    if isinstance(types, list):
        bounds = [document_bound({**schema, "type": t}) for t in types]
        return None if not bounds or None in bounds else max(bounds)
    if types == "null":
        return 4
    if types == "boolean":
        return 5
    if types in ("integer", "number"):
        return _number_bound(bounded_numbers(schema))
    if types == "string":
        return None if "maxLength" not in schema else 2 + 12 * int(schema["maxLength"])
    if types == "array":
        return _array_bound(schema)
    if types == "object":
        return _object_bound(schema)
    return None


def _value_bound(value: Any) -> int:
    """A JSON value written with any escapes: each UTF-16 unit of a string may be `\\uXXXX`."""
    if isinstance(value, str):
        return 2 + 6 * len(value.encode("utf-16-le")) // 2
    if isinstance(value, list):
        return 2 + sum(_value_bound(v) for v in value) + 2 * max(len(value) - 1, 0)
    if isinstance(value, dict):
        return 2 + sum(_value_bound(k) + 2 + _value_bound(v) for k, v in value.items()) \
            + 2 * max(len(value) - 1, 0)
    return len(json.dumps(value))


def _number_bound(schema: dict) -> int:
    ends = [schema.get(k) for k in ("minimum", "maximum", "exclusiveMinimum",
                                    "exclusiveMaximum")]
    digits = max(len(str(int(abs(e)))) for e in ends if isinstance(e, int | float))
    step = Decimal(str(schema.get("multipleOf", 1)))
    decimals = max(-step.normalize().as_tuple().exponent, 0)
    return 1 + digits + (1 + decimals if decimals else 0)   # sign, digits, point, decimals


def _array_bound(schema: dict) -> int | None:
    prefix = schema.get("prefixItems") or []
    most = schema.get("maxItems")
    if most is None and not (prefix and schema.get("items") is False):
        return None
    most = len(prefix) if most is None else int(most)
    bounds = [document_bound(s) for s in prefix[:most]]
    if most > len(prefix):
        bounds += [document_bound(schema.get("items", {}))] * (most - len(prefix))
    if None in bounds:
        return None
    return 2 + sum(bounds) + 2 * max(len(bounds) - 1, 0)


def _object_bound(schema: dict) -> int | None:
    if schema.get("additionalProperties", True) is not False or schema.get("patternProperties"):
        return None
    total = 2
    props = schema.get("properties", {})
    for key, sub in props.items():
        bound = document_bound(sub)
        if bound is None:
            return None
        total += _value_bound(key) + 2 + bound
    return total + 2 * max(len(props) - 1, 0)

