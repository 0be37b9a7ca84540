"""What a request asks its output to match, read into the grammar the engine holds it to
(reply_grammar.py), and its logit bias.

An answer format comes from one field at most. Chat and text completions: OpenAI's
`response_format` (`json_object`, `json_schema` with `strict`), vLLM's `structured_outputs`
(`json`, `regex`, `choice`, `grammar`, `json_object`) or its older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (`answer_format`). Other APIs read their own
field into an `AskedFormat` (the Responses API's `text.format`). A tool choice adds tool
calls (`tool_calls`): "required" or a named function forces them; in "auto", strict tools'
arguments are held to their schemas.

`constrain` takes what a request asked for (an answer format, tool calls, a logit bias) and
puts the compiled grammar into its sampling parameters; the path underneath every API
(submission.py) calls it. Everything is checked before the request is queued: a format that
cannot be built, a grammar that does not compile (in a worker thread, within the server's
timeout) or is too large, a biased token outside the vocabulary is a 400 naming the field and
the problem. With thinking on, the reasoning budget is set so that the answer gets its turn
(`answer_turn`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..engine.grammar import GrammarError
from ..lifecycle.request import SamplingParams
from ..model.tokenizer import Tokenizer
from .errors import ApiError, bad_request
from .reasoning import bounded
from .reply_grammar import OutputFormat, ToolCalls, ToolFormat, document_bound, reply_grammar
from .schemas import SamplingFields

GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"),
          ("guided_choice", "choice"), ("guided_grammar", "lark"))


class AskedFormat(NamedTuple):
    """An answer format and the request field that asked for it (a 400's `param`)."""

    format: OutputFormat
    field: str


def answer_format(body: SamplingFields) -> AskedFormat | None:
    """A chat or text completion's answer format (None: free text)."""
    found: list[AskedFormat] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(AskedFormat(OutputFormat("json_object"), "response_format"))
    elif rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        found.append(AskedFormat(OutputFormat("json_schema", js.schema_, bool(js.strict)),
                                 "response_format"))
    so = body.structured_outputs
    if so is not None:
        if so.json_ is not None:
            fmt = OutputFormat("json_schema", _schema(so.json_, "structured_outputs.json"))
        elif so.regex is not None:
            fmt = OutputFormat("regex", so.regex)
        elif so.choice is not None:
            fmt = OutputFormat("choice", tuple(so.choice))
        elif so.grammar is not None:
            fmt = OutputFormat("lark", so.grammar)
        else:
            fmt = OutputFormat("json_object")
        found.append(AskedFormat(fmt, "structured_outputs"))
    for field, kind in GUIDED:
        value = getattr(body, field)
        if value is not None:
            spec = _schema(value, field) if kind == "json_schema" else value
            found.append(AskedFormat(
                OutputFormat(kind, tuple(spec) if kind == "choice" else spec), field))
    if len(found) > 1:
        fields = ", ".join(f.field for f in found)
        raise bad_request(f"give one output format, not several ({fields})", found[1].field)
    return found[0] if found else None


def _schema(value: dict | str, field: str) -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise bad_request(f"{field}: not a JSON schema: {exc}", field) from None
    if not isinstance(value, dict):
        raise bad_request(f"{field}: a JSON schema must be an object", field)
    return value


def tool_calls(tools: Sequence[ToolFormat], choice: str | None,
               parallel: bool | None = None) -> ToolCalls | None:
    """The tool calls a tool choice asks for: `choice` "auto" (or None), "none",
    "required" or the name of the function to call (None: no tools, or "none")."""
    if not tools or choice == "none":
        return None
    parallel = parallel is not False
    if choice in (None, "auto"):
        return ToolCalls(tuple(tools), "auto", parallel)
    if choice == "required":
        return ToolCalls(tuple(tools), "required", parallel)
    return ToolCalls(tuple(t for t in tools if t.name == choice), "named", False)


async def constrain(server, params: SamplingParams, *, answer: AskedFormat | None,
                    calls: ToolCalls | None, bias: tuple[tuple[int, float], ...] = (),
                    reasoning: bool, room: int | None) -> SamplingParams:
    """`params` with a reply's grammar (compiled, or a 400 naming the field the answer
    format came from, else `tools`) and logit bias ((token id, bias) pairs; an id outside
    the vocabulary is a 400 naming `logit_bias`). `reasoning`: the prompt left a reasoning
    block open, so the grammar starts after its end token, and the reasoning budget leaves
    the answer its turn (`answer_turn`); `room`: the most tokens the reply may have when the
    client set no max_tokens (None when it did): a strict, bounded document then gets the
    room to complete."""
    if any(not 0 <= t < server.vocab_size for t, _ in bias):
        raise bad_request(f"logit_bias: token ids must be in [0, {server.vocab_size})",
                          "logit_bias")
    special = server.tokenizer.special
    param = answer.field if answer is not None else "tools"
    fmt = answer.format if answer is not None else None
    try:
        grammar = reply_grammar(fmt, calls, after_reasoning=reasoning)
    except ValueError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    if grammar is None:
        return dataclasses.replace(params, logit_bias=bias) if bias else params
    if calls is not None and (special.tool_call_start is None or special.tool_call_end is None):
        raise bad_request("this model's tokenizer has no tool-call tokens to constrain "
                          "calls with", param)
    if reasoning and special.think_end is None:
        raise bad_request("this model's tokenizer has no end-of-reasoning token", param)
    grammars = server.thread.engine.grammars
    timeout = server.settings.grammar_timeout
    try:
        await asyncio.wait_for(asyncio.to_thread(grammars.compile, grammar), timeout)
    except GrammarError as exc:
        raise bad_request(f"{param}: {exc}", param) from None
    except TimeoutError:  # the compile goes on in its thread, bounded by llguidance's fuel
        raise ApiError(400, f"{param}: the grammar took longer than {timeout:g} s to compile",
                       param=param, code="grammar_too_complex") from None
    bound = document_bound(fmt.spec) if fmt is not None and fmt.strict \
        and fmt.kind == "json_schema" else None
    constrained = dataclasses.replace(
        params, grammar=grammar, logit_bias=bias,
        grammar_after=special.think_end if reasoning else None,
        stop_tokens=tuple(sorted(set(params.stop_tokens) | set(grammars.end_tokens))))
    # every token is a byte or more, and the end token comes after the document
    return answer_turn(constrained, None if bound is None else bound + 1, room,
                       server.tokenizer if reasoning else None)


def answer_turn(params: SamplingParams, need: int | None, room: int | None,
                tokenizer: Tokenizer | None) -> SamplingParams:
    """A constrained reply's output limit and reasoning budget, so that its answer gets its
    turn. `need`: the most tokens the answer takes (a strict, bounded document), None when
    unknown; `room`: the most tokens the reply may have when the client set no limit (None
    when it did); `tokenizer`: the prompt left a reasoning block open (None: it did not).

    Without reasoning, a limit the client did not set is raised to `need`. With reasoning,
    such a limit is raised to the request's budget, the close and `need`; then the budget is
    at most the limit less the close and `need` (half the limit when `need` is unknown), and
    a request without a budget gets that one: the reasoning is closed in time for the
    answer to start (and, with `need` known, to complete)."""
    limit = params.max_tokens
    if tokenizer is None:
        if room is not None and need is not None:
            limit = max(limit, min(need, room))
        return dataclasses.replace(params, max_tokens=limit)
    closing = bounded(params, 0, tokenizer)
    if not closing.reasoning_close:   # nothing could close the block: no budget to set
        return params
    close = len(closing.reasoning_close)
    budget = params.reasoning_budget
    if room is not None and need is not None:
        limit = max(limit, min((budget or 0) + close + need, room))
    most = max(limit - close - (need if need is not None else limit // 2), 0)
    budget = most if budget is None else min(budget, most)
    return bounded(dataclasses.replace(params, max_tokens=limit), budget, tokenizer)
