"""The Responses API's grammar: one generation's deltas (reasoning, content, tool calls, as
`parsing` finds them) as output items, streamed as events or returned as one response.

A stream: `response.created`, `response.in_progress`; per item `response.output_item.added`,
its deltas (`response.content_part.added`, `response.reasoning_text.delta` / `.done` or
`response.output_text.delta` / `.done`, `response.content_part.done`; a call's
`response.function_call_arguments.delta` / `.done` or `response.custom_tool_call_input.delta`
/ `.done`), `response.output_item.done`; then `response.completed` (or
`response.incomplete` when the output limit cut the reply) carrying the whole response with
its usage, or `response.failed` with an error code. Every event has a `sequence_number`,
from 0; its SSE `event:` line repeats its `type`. The reasoning item is always output 0
when there is one; a model turn's reasoning, text and calls follow in that order."""

from __future__ import annotations

import json
import time
from typing import Literal, NamedTuple

from starlette.responses import Response

from .bodies import Body, wire
from .errors import ApiError
from .generation import Generation
from .parsing import Delta, ParsedCall
from .responses_bodies import (
    ContentPartAdded,
    ContentPartDone,
    CustomToolCallInputDelta,
    CustomToolCallInputDone,
    CustomToolCallItem,
    FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone,
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    MessageItem,
    NamedToolChoice,
    OutputItem,
    OutputItemAdded,
    OutputItemDone,
    OutputText,
    OutputTextDelta,
    OutputTextDone,
    OutputTokensDetails,
    ReasoningEcho,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDelta,
    ReasoningTextDone,
    ResponseCompleted,
    ResponseCreated,
    ResponseError,
    ResponseFailed,
    ResponseIncomplete,
    ResponseInProgress,
    ResponseObject,
    ResponseStatus,
    ResponseUsage,
    TextOptions,
    ToolEcho,
)
from .sealed_reasoning import reasoning_span, seal
from .streaming import StreamShape, TextEvents

CUSTOM_INPUT = "input"   # the one parameter a custom tool is presented with


class CalledAs(NamedTuple):
    """How a tool presented to the model is called back to the client."""

    kind: Literal["function", "custom"]
    name: str
    namespace: str | None


class Echo(NamedTuple):
    """What the response object repeats of its request."""

    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    effort: str | None
    summary: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str | NamedToolChoice
    tools: tuple[ToolEcho, ...]
    prompt_cache_key: str | None
    metadata: dict[str, str]
    sealed_reasoning: bool    # include ["reasoning.encrypted_content"]
    text: TextOptions = TextOptions()   # the answer's format


def event_bytes(event: Body) -> bytes:
    """One SSE event: its type on the `event:` line, its JSON on the `data:` line."""
    return f"event: {event.type}\ndata: {wire(event)}\n\n".encode()


class SequencedTextEvents:
    """`TextEvents` for the Responses API's text deltas, whose events also differ in their
    `sequence_number`: the item's delta event made once with NUMBER for the number and the
    mark for the text, split around both, each event's number and text's JSON spliced in
    (byte for byte what `event_bytes` makes of the body: 0.5 against 7 us a delta)."""

    NUMBER = 7_340_032_000_000_000_001   # a template's number (no stream gets this far)
    _KEY = '"sequence_number": '

    def __init__(self, template: bytes) -> None:
        text = TextEvents(template)
        head, found, mid = text.head.partition(f"{self._KEY}{self.NUMBER}")
        if not found:
            raise ValueError("the template holds no sequence number mark")
        self.head, self.mid, self.tail = head + self._KEY, mid, text.tail
        self._string = text._string

    def event(self, number: int, text: str) -> bytes:
        return (self.head + str(number) + self.mid + self._string(text) + self.tail).encode()


def error_code(error: ApiError) -> str:
    """A failure's code in the response's `error`."""
    if error.code == "context_length_exceeded":
        return error.code
    if error.status == 429 or error.code == "capacity":
        return "rate_limit_exceeded"
    return "server_error" if error.status >= 500 else "invalid_prompt"


class Lifecycle:
    """The response object at each point of one response's life."""

    def __init__(self, response_id: str, model: str, echo: Echo) -> None:
        self.id, self.model, self.echo = response_id, model, echo
        self.created = int(time.time())
        self.seq = 0

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq - 1

    def response(self, status: ResponseStatus, output: list[OutputItem] = (),
                 usage: ResponseUsage | None = None, error: ApiError | None = None
                 ) -> ResponseObject:
        echo = self.echo
        return ResponseObject(
            id=self.id, created_at=self.created, status=status,
            error=None if error is None else ResponseError(code=error_code(error),
                                                           message=error.message),
            incomplete_details=(IncompleteDetails(reason="max_output_tokens")
                                if status == "incomplete" else None),
            instructions=echo.instructions, max_output_tokens=echo.max_output_tokens,
            model=self.model, output=list(output), parallel_tool_calls=echo.parallel_tool_calls,
            prompt_cache_key=echo.prompt_cache_key,
            reasoning=ReasoningEcho(effort=echo.effort, summary=echo.summary),
            temperature=echo.temperature, tool_choice=echo.tool_choice, tools=list(echo.tools),
            top_p=echo.top_p, usage=usage, metadata=echo.metadata, text=echo.text)

    def opening(self) -> list[bytes]:
        started = self.response("in_progress")
        return [event_bytes(ResponseCreated(sequence_number=self.next_seq(), response=started)),
                event_bytes(ResponseInProgress(sequence_number=self.next_seq(),
                                               response=started))]


class _Open:
    """The reasoning or message item being written."""

    def __init__(self, kind: str, index: int, item_id: str) -> None:
        self.kind, self.index, self.id = kind, index, item_id
        self.parts: list[str] = []
        self.deltas: SequencedTextEvents | None = None   # its text deltas' events


def custom_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote: its `input` string (or its
    one string argument, whatever its name), else the arguments' text."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    if isinstance(value, dict):
        if isinstance(value.get(CUSTOM_INPUT), str):
            return value[CUSTOM_INPUT]
        strings = [v for v in value.values() if isinstance(v, str)]
        if len(value) == 1 and strings:
            return strings[0]
    return arguments


class ResponsesShape(StreamShape):
    """One generation as a response, streamed or whole (the module's docstring)."""

    def __init__(self, gen: Generation, echo: Echo, tools: dict[str, CalledAs]) -> None:
        self.gen, self.tools = gen, tools
        self.life = Lifecycle(f"resp_{gen.id}", gen.server.settings.model_id, echo)
        self.done: list[OutputItem] = []
        self.open: _Open | None = None
        self.reasoning_tokens = 0

    def _event(self, kind: type[Body], **fields) -> bytes:
        return event_bytes(kind(sequence_number=self.life.next_seq(), **fields))

    def _item_id(self, prefix: str, index: int) -> str:
        return f"{prefix}_{self.gen.id.replace('-', '_')}_{index}"

    # --- items ---------------------------------------------------------------------------

    def _start(self, kind: str) -> list[bytes]:
        index = len(self.done)
        item_id = self._item_id("rs" if kind == "reasoning" else "msg", index)
        self.open = _Open(kind, index, item_id)
        delta = ReasoningTextDelta if kind == "reasoning" else OutputTextDelta
        self.open.deltas = SequencedTextEvents(event_bytes(delta(
            sequence_number=SequencedTextEvents.NUMBER, item_id=item_id, output_index=index,
            content_index=0, delta=TextEvents.MARK)))
        if kind == "reasoning":
            item, part = ReasoningItem(id=item_id, content=[], status="in_progress"), \
                ReasoningText(text="")
        else:
            item, part = MessageItem(id=item_id, status="in_progress", content=[]), \
                OutputText(text="")
        return [self._event(OutputItemAdded, output_index=index, item=item),
                self._event(ContentPartAdded, item_id=item_id, output_index=index,
                            content_index=0, part=part)]

    def _sealed(self, text: str, first: bool) -> str | None:
        """The reasoning item's encrypted_content (and its reasoning tokens counted)."""
        gen = self.gen
        ids: tuple[int, ...] = ()
        if first:   # the reasoning the output starts with: its ids are the output's first
            ids = reasoning_span(gen.outputs, gen.server.tokenizer.decode, gen.hidden_ids)
            self.reasoning_tokens = len(ids)
        if not self.life.echo.sealed_reasoning:
            return None
        return seal(gen.server.settings.model_id, text, ids)

    def _finish(self) -> list[bytes]:
        """Close the item being written, if any."""
        if self.open is None:
            return []
        now, self.open = self.open, None
        text = "".join(now.parts)
        where = {"item_id": now.id, "output_index": now.index, "content_index": 0}
        if now.kind == "reasoning":
            part = ReasoningText(text=text)
            item = ReasoningItem(id=now.id, content=[part], status="completed",
                                 encrypted_content=self._sealed(text, now.index == 0))
            out = [self._event(ReasoningTextDone, text=text, **where)]
        else:
            part = OutputText(text=text)
            item = MessageItem(id=now.id, status="completed", content=[part])
            out = [self._event(OutputTextDone, text=text, **where)]
        self.done.append(item)
        return [*out, self._event(ContentPartDone, part=part, **where),
                self._event(OutputItemDone, output_index=now.index, item=item)]

    def _call(self, call: ParsedCall) -> list[bytes]:
        index = len(self.done)
        called = self.tools.get(call.name, CalledAs("function", call.name, None))
        if called.kind == "custom":
            item_id = self._item_id("ctc", index)
            value = custom_input(call.arguments)
            item = CustomToolCallItem(id=item_id, call_id=call.id, name=called.name,
                                      input=value, namespace=called.namespace)
            out = [self._event(OutputItemAdded, output_index=index,
                               item=item.model_copy(update={"input": ""})),
                   self._event(CustomToolCallInputDelta, item_id=item_id, output_index=index,
                               delta=value),
                   self._event(CustomToolCallInputDone, item_id=item_id, output_index=index,
                               input=value)]
        else:
            item_id = self._item_id("fc", index)
            item = FunctionCallItem(id=item_id, call_id=call.id, name=called.name,
                                    arguments=call.arguments, namespace=called.namespace,
                                    status="completed")
            out = [self._event(OutputItemAdded, output_index=index, item=item.model_copy(
                       update={"arguments": "", "status": "in_progress"})),
                   self._event(FunctionCallArgumentsDelta, item_id=item_id, output_index=index,
                               delta=call.arguments),
                   self._event(FunctionCallArgumentsDone, item_id=item_id, output_index=index,
                               arguments=call.arguments)]
        self.done.append(item)
        return [*out, self._event(OutputItemDone, output_index=index, item=item)]

    # --- the shape -----------------------------------------------------------------------

    def opening(self) -> list[bytes]:
        return self.life.opening()

    def on_delta(self, d: Delta) -> list[bytes]:
        if d.kind == "tool_call":
            return [*self._finish(), *self._call(d.call)]
        kind = "reasoning" if d.kind == "reasoning" else "message"
        out = []
        if self.open is None or self.open.kind != kind:
            out += self._finish()
            out += self._start(kind)
        self.open.parts.append(d.text)
        return [*out, self.open.deltas.event(self.life.next_seq(), d.text)]

    def _usage(self) -> ResponseUsage:
        gen = self.gen
        prompt = len(gen.prompt)
        if self.reasoning_tokens == 0 and self.done and isinstance(self.done[0], ReasoningItem):
            self.reasoning_tokens = gen.completion_tokens
        return ResponseUsage(
            input_tokens=prompt, input_tokens_details=InputTokensDetails(
                cached_tokens=gen.reuse_base),
            output_tokens=gen.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=self.reasoning_tokens),
            total_tokens=prompt + gen.completion_tokens)

    def _final(self) -> ResponseObject:
        status = "incomplete" if self.gen.finish_reason == "length" else "completed"
        return self.life.response(status, self.done, self._usage())

    def closing(self) -> list[bytes]:
        out = self._finish()
        final = self._final()
        kind = ResponseIncomplete if final.status == "incomplete" else ResponseCompleted
        return [*out, self._event(kind, response=final)]

    def failing(self, error: ApiError) -> list[bytes]:
        out = self._finish()
        failed = self.life.response("failed", self.done, self._usage(), error)
        return [*out, self._event(ResponseFailed, response=failed)]

    def body(self, deltas: list[Delta]) -> ResponseObject:
        for d in deltas:
            self.on_delta(d)
        self._finish()
        return self._final()


class FailedStream(Response):
    """A stream that fails before its generation started (a prompt over the context):
    `response.created`, `response.in_progress`, `response.failed`, as OpenAI streams it."""

    def __init__(self, life: Lifecycle, error: ApiError) -> None:
        events = life.opening()
        failed = life.response("failed", error=error)
        events.append(event_bytes(ResponseFailed(sequence_number=life.next_seq(),
                                                 response=failed)))
        super().__init__(b"".join(events), media_type="text/event-stream",
                         headers={"cache-control": "no-cache"})
