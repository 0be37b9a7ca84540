"""The OpenAI Responses API, stateless: `POST /v1/responses` read into its pydantic model
(responses_schema.py), converted to the one request type underneath (unified.py) and started
on the path underneath; the stream and the body are shaped in responses_stream.py.

Input: a string (one user message) or items: `message` (roles user / assistant / system /
developer; `input_text`, `output_text`, `refusal` parts), `function_call`,
`function_call_output`, `custom_tool_call`, `custom_tool_call_output` and `reasoning` (its
`content`, else the reasoning sealed in its `encrypted_content`; with neither, nothing).
`instructions` and every system and developer message are merged, in order, into one leading
system message. Consecutive assistant items (reasoning, message, calls) are one model turn.

Tools: `function`; `custom` (freeform), presented to the model as a function of one string
parameter `input`; `namespace`, whose tools are presented as `NAMESPACE.NAME`; any other
(built-in) type is dropped, with one warning line in the log the first time a type is seen.

Constrained output, as on chat completions (formats.py): `text.format` `json_schema` (with
`strict`) or `json_object` holds the answer to a grammar, `tool_choice` `required` (or
`allowed_tools` with mode `required`) and a named tool force well-formed calls; a format
that cannot be built is a 400 naming `text.format` (or `tools`).

This server keeps no responses: `store` is accepted and ignored, `previous_response_id`
and `conversation` get a 400 asking for the whole input, `background` a 400."""

from __future__ import annotations

import json
import logging
import time
from typing import NamedTuple

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from . import sessions
from .errors import ApiError
from .formats import AskedFormat
from .reading import ClientGone, read_json, validate
from .reasoning import budget_for_effort
from .reply_grammar import InputGrammar, OutputFormat
from .responses_bodies import (
    CustomToolEcho,
    FunctionToolEcho,
    NamedToolChoice,
    NamespaceToolEcho,
    TextOptions,
)
from .responses_bodies import JsonObjectFormat as JsonObjectEcho
from .responses_bodies import JsonSchemaFormat as JsonSchemaEcho
from .responses_schema import (
    TAGS,
    AllowedTools,
    CallOutputItem,
    CustomTool,
    CustomToolCallItem,
    FunctionCallItem,
    FunctionTool,
    JsonObjectFormat,
    JsonSchemaFormat,
    MessageItem,
    NamedTool,
    NamespaceTool,
    ReasoningItem,
    ReasoningOptions,
    ResponsesRequest,
    text_of,
)
from .responses_stream import (
    CUSTOM_INPUT,
    CalledAs,
    Echo,
    FailedStream,
    Lifecycle,
    ResponsesShape,
)
from .sealed_reasoning import unseal
from .sessions import KeySource
from .streaming import GenerationResponse
from .submission import check_ready, start
from .unified import ChatMessage, PinnedText, Sampling, ToolCallRecord, ToolSpec, UnifiedRequest

log = logging.getLogger("ninfer.server")

ROUTE = "openai-responses"
_WARNED: set[str] = set()   # built-in tool types already named in the log


# --- conversion ---------------------------------------------------------------------------


class Converted(NamedTuple):
    request: UnifiedRequest
    tools: dict[str, CalledAs]     # by the name the model sees


def reasoning_switch(effort: str | None) -> bool | None:
    """`reasoning.effort` as the template's thinking switch: `none` turns thinking off, any
    other effort on, none given leaves the template's default. (The one place the effort
    becomes the request's reasoning switch.)"""
    if effort is None:
        return None
    return effort != "none"


def _tool_spec(tool: FunctionTool | CustomTool, name: str) -> ToolSpec:
    if isinstance(tool, FunctionTool):
        return ToolSpec(name, tool.description, tool.parameters, tool.strict)
    described = tool.description or ""
    grammar = None
    if tool.format is not None and tool.format.type == "grammar" and tool.format.definition:
        syntax = tool.format.syntax or "lark"
        described += f"\n\nThe input follows this {syntax} grammar:\n{tool.format.definition}"
        grammar = InputGrammar(syntax, tool.format.definition, CUSTOM_INPUT)
    return ToolSpec(name, described.strip() or None, {
        "type": "object", "properties": {CUSTOM_INPUT: {"type": "string"}},
        "required": [CUSTOM_INPUT]}, input=grammar)


def convert_tools(tools: list | None) -> tuple[tuple[ToolSpec, ...], dict[str, CalledAs]]:
    """The tools as the model sees them, and how each is called back. Raises ValueError for
    two tools under one name."""
    specs: list[ToolSpec] = []
    called: dict[str, CalledAs] = {}
    dropped: list[str] = []

    def add(tool: FunctionTool | CustomTool, namespace: str | None) -> None:
        name = f"{namespace}.{tool.name}" if namespace else tool.name
        if name in called:
            raise ValueError(f"two tools are named {name!r}")
        called[name] = CalledAs(tool.type, tool.name, namespace)
        specs.append(_tool_spec(tool, name))

    for tool in tools or ():
        if isinstance(tool, NamespaceTool):
            for inner in tool.tools:
                add(inner, tool.name)
        elif isinstance(tool, FunctionTool | CustomTool):
            add(tool, None)
        else:
            dropped.append(tool.type)
    unseen = sorted(set(dropped) - _WARNED)
    if unseen:   # once per tool type: an agent sends its built-in tools with every turn
        _WARNED.update(unseen)
        log.warning("responses: dropped tools this server does not run: %s (said once)",
                    ", ".join(unseen))
    return tuple(specs), called


def _called_name(name: str, namespace: str | None) -> str:
    return f"{namespace}.{name}" if namespace else name


class _Turns:
    """Input items folded into chat messages: consecutive assistant items are one turn."""

    def __init__(self, unseal_reasoning) -> None:
        self.messages: list[ChatMessage] = []
        self.pinned: list[PinnedText] = []
        self.unseal = unseal_reasoning
        self._open = False   # the last message is an assistant turn that may grow

    def _assistant(self, *, fresh: bool = False) -> ChatMessage:
        if fresh or not self._open:
            self.messages.append(ChatMessage("assistant"))
            self._open = True
        return self.messages[-1]

    def _replace(self, message: ChatMessage) -> None:
        self.messages[-1] = message

    def add(self, item) -> None:
        if isinstance(item, MessageItem):
            if item.role == "assistant":
                turn = self._assistant()
                if turn.tool_calls:   # text after calls is a turn of its own
                    turn = self._assistant(fresh=True)
                self._replace(turn._replace(content=turn.content + text_of(item.content)))
                return
            role = "system" if item.role == "developer" else item.role
            self.messages.append(ChatMessage(role, text_of(item.content)))
        elif isinstance(item, ReasoningItem):
            text = "".join(p.text for p in item.content or ())
            sealed = self.unseal(item.encrypted_content) if item.encrypted_content else None
            if sealed is not None and sealed.ids:
                self.pinned.append(PinnedText(sealed.text, sealed.ids))
            if not text and sealed is not None:
                text = sealed.reasoning
            if not text:
                return   # nothing to render: a no-op
            turn = self._assistant(fresh=True)
            self._replace(turn._replace(reasoning=(turn.reasoning or "") + text))
            return
        elif isinstance(item, FunctionCallItem | CustomToolCallItem):
            turn = self._assistant()
            name = _called_name(item.name, item.namespace)
            arguments = (item.arguments if isinstance(item, FunctionCallItem)
                         else json.dumps({CUSTOM_INPUT: item.input}, ensure_ascii=False))
            call = ToolCallRecord(item.call_id, name, arguments)
            self._replace(turn._replace(tool_calls=(*turn.tool_calls, call)))
            return
        elif isinstance(item, CallOutputItem):
            self.messages.append(ChatMessage("tool", text_of(item.output),
                                             tool_call_id=item.call_id))
        self._open = False


def answer_of(body: ResponsesRequest) -> AskedFormat | None:
    """`text.format` as the answer's format (None: free text)."""
    fmt = body.text.format if body.text is not None else None
    if isinstance(fmt, JsonSchemaFormat):
        return AskedFormat(OutputFormat("json_schema", fmt.schema_, bool(fmt.strict)),
                           "text.format")
    if isinstance(fmt, JsonObjectFormat):
        return AskedFormat(OutputFormat("json_object"), "text.format")
    return None


class SealedText(NamedTuple):
    reasoning: str
    text: str                 # what the sealed ids decode to
    ids: tuple[int, ...]


def to_unified(body: ResponsesRequest, *, model: str, vocab_size: int, decode,
               default_budget: int | None) -> Converted:
    """The request in the one type underneath; `default_budget` is the server's reasoning
    budget, for a request whose `reasoning.effort` names none. Raises ValueError for what the
    schema cannot see (two tools under one name, a conversation with nothing to answer)."""

    def unseal_reasoning(blob: str) -> SealedText | None:
        found = unseal(blob, model, vocab_size)
        if found is None:
            log.warning("responses: a reasoning item's encrypted_content is not this "
                        "server's; its reasoning is not rendered")
            return None
        return SealedText(found.reasoning, decode(found.ids) if found.ids else "", found.ids)

    turns = _Turns(unseal_reasoning)
    if body.instructions:
        turns.add(MessageItem(role="system", content=body.instructions))
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) \
        else body.input
    for item in items:
        turns.add(item)
    if not any(m.role != "system" for m in turns.messages):
        raise ValueError("input has no user message, tool output or assistant turn")
    tools, called = convert_tools(body.tools)
    choice = body.tool_choice
    if isinstance(choice, NamedTool):
        if choice.name not in called:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        choice_name: str | None = choice.name
    elif isinstance(choice, AllowedTools):
        choice_name = choice.mode
    else:
        choice_name = choice
    if choice_name not in (None, "none", "auto") and not tools:
        raise ValueError("tool_choice needs tools")
    effort = body.reasoning.effort if body.reasoning else None
    request = UnifiedRequest(
        route=ROUTE, model=body.model, messages=tuple(turns.messages), tools=tools,
        tool_choice=choice_name, parallel_tool_calls=body.parallel_tool_calls,
        reasoning=reasoning_switch(effort),
        reasoning_budget=budget_for_effort(effort, default_budget),
        sampling=Sampling(max_tokens=body.max_output_tokens, open_ended=True,
                          temperature=body.temperature, top_p=body.top_p),
        answer=answer_of(body), key_sources=(KeySource("cache", body.prompt_cache_key),),
        derive_key=True, cache_salt=body.cache_salt, merge_system=True,
        pinned=tuple(turns.pinned))
    return Converted(request, called)


def _tool_echo(tool: FunctionTool | CustomTool) -> FunctionToolEcho | CustomToolEcho:
    if isinstance(tool, FunctionTool):
        return FunctionToolEcho(name=tool.name, description=tool.description,
                                parameters=tool.parameters, strict=tool.strict)
    return CustomToolEcho(name=tool.name, description=tool.description,
                          format=tool.format.model_dump(exclude_none=True) if tool.format
                          else None)


def echo_of(body: ResponsesRequest) -> Echo:
    """What the response repeats of the request: the tools it serves (built-in ones
    dropped), the settings in effect."""
    tools = []
    for tool in body.tools or ():
        if isinstance(tool, NamespaceTool):
            tools.append(NamespaceToolEcho(name=tool.name, description=tool.description,
                                           tools=[_tool_echo(t) for t in tool.tools]))
        elif isinstance(tool, FunctionTool | CustomTool):
            tools.append(_tool_echo(tool))
    choice = body.tool_choice
    if isinstance(choice, NamedTool):
        choice = NamedToolChoice(type=choice.type, name=choice.name)
    elif isinstance(choice, AllowedTools):
        choice = choice.mode
    reasoning = body.reasoning or ReasoningOptions()
    fmt = body.text.format if body.text is not None else None
    text = TextOptions()
    if isinstance(fmt, JsonSchemaFormat):
        text = TextOptions(format=JsonSchemaEcho(name=fmt.name, schema=fmt.schema_,
                                                 description=fmt.description, strict=fmt.strict))
    elif isinstance(fmt, JsonObjectFormat):
        text = TextOptions(format=JsonObjectEcho())
    return Echo(
        instructions=body.instructions, max_output_tokens=body.max_output_tokens,
        parallel_tool_calls=body.parallel_tool_calls is not False, effort=reasoning.effort,
        summary=reasoning.summary, temperature=body.temperature, top_p=body.top_p,
        tool_choice=choice or "auto", tools=tuple(tools),
        prompt_cache_key=body.prompt_cache_key, metadata=dict(body.metadata or {}),
        sealed_reasoning=body.sealed_reasoning, text=text)


# --- the route ----------------------------------------------------------------------------


def _param(exc: ApiError) -> ApiError:
    """An error of the path underneath in this API's field names."""
    names = {"messages": "input", "max_tokens": "max_output_tokens"}
    if exc.param not in names:
        return exc
    return ApiError(exc.status, exc.message.replace("max_tokens", "max_output_tokens"),
                    param=names[exc.param], code=exc.code, retry_after=exc.retry_after)


router = APIRouter()


@router.post("/v1/responses")
async def create_response(request: Request):
    server = request.app.state.server
    arrival = time.time()
    body = None
    try:
        api_key = sessions.authenticate(request.headers, server.settings.api_keys)
        data = await read_json(request, server.settings.max_body_bytes)
        check_ready(server)
        body = validate(ResponsesRequest, data, TAGS)
        try:
            converted = to_unified(body, model=server.settings.model_id,
                                   vocab_size=server.vocab_size,
                                   decode=server.tokenizer.decode,
                                   default_budget=server.settings.reasoning_budget)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="input") from None
        gen = await start(server, converted.request, headers=request.headers,
                          api_key=api_key, arrival=arrival)
    except ApiError as exc:
        exc = _param(exc)
        server.metrics.response(exc.status)
        if body is not None and body.stream and exc.code == "context_length_exceeded":
            # as OpenAI streams it: a response that failed
            life = Lifecycle(f"resp_{server.next_request_id()}", server.settings.model_id,
                             echo_of(body))
            return FailedStream(life, exc)
        return exc.response()
    except ClientGone:
        server.metrics.response(499)
        return PlainTextResponse("", status_code=499)
    shape = ResponsesShape(gen, echo_of(body), converted.tools)
    return GenerationResponse(gen, shape, stream=body.stream)
