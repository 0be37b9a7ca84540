"""Anthropic's Messages API, the response side: the message body and the stream's event
grammar, built from a generation's deltas (reasoning, text, tool calls: server/parsing.py).

The stream: `message_start` (the message without content, usage with the prompt's
figures), then per content block `content_block_start`, its deltas (`thinking_delta` and a
`signature_delta` that closes each thinking block, `text_delta`, `input_json_delta` holding
a tool call's whole input as JSON), `content_block_stop`; then `message_delta` (stop reason,
the stop sequence that fired, usage) and `message_stop`. `ping` events keep the connection
alive while nothing else is sent (a long prompt prefilling). A failure after the stream
started is an `error` event.

Usage as Anthropic counts it: `input_tokens` are the prompt tokens not read from the cache,
`cache_read_input_tokens` the ones reused (the plan's reuse base), nothing is billed as
cache creation. Bodies are strict and closed, like bodies.py's."""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import Field

from .bodies import Body
from .errors import ApiError
from .generation import Generation
from .messages_api import error_body, signature
from .parsing import Delta
from .streaming import GenerationResponse

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use",
                     "model_context_window_exceeded"]


class MessagesUsage(Body):
    input_tokens: int              # prompt tokens computed (not read from the cache)
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int   # prompt tokens reused


class TextContent(Body):
    type: Literal["text"] = "text"
    text: str


class ThinkingContent(Body):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str


class ToolUseContent(Body):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


Content = Annotated[TextContent | ThinkingContent | ToolUseContent, Field(discriminator="type")]


class MessageBody(Body):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[Content]
    stop_reason: StopReason | None     # None only in `message_start`
    stop_sequence: str | None
    usage: MessagesUsage


class TokenCount(Body):
    input_tokens: int


# --- stream events ----------------------------------------------------------------------------


class MessageStart(Body):
    type: Literal["message_start"] = "message_start"
    message: MessageBody


class BlockStart(Body):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: Content


class TextDelta(Body):
    type: Literal["text_delta"] = "text_delta"
    text: str


class ThinkingDelta(Body):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


class SignatureDelta(Body):
    type: Literal["signature_delta"] = "signature_delta"
    signature: str


class InputJsonDelta(Body):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class BlockDelta(Body):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: Annotated[TextDelta | ThinkingDelta | SignatureDelta | InputJsonDelta,
                     Field(discriminator="type")]


class BlockStop(Body):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class StopDelta(Body):
    stop_reason: StopReason
    stop_sequence: str | None


class MessageDelta(Body):
    type: Literal["message_delta"] = "message_delta"
    delta: StopDelta
    usage: MessagesUsage


class MessageStop(Body):
    type: Literal["message_stop"] = "message_stop"


class Ping(Body):
    type: Literal["ping"] = "ping"


def event(body: Body | dict) -> bytes:
    """One server-sent event, named by the body's `type`."""
    data = body if isinstance(body, dict) else body.model_dump()
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


_BLOCK_OF = {"reasoning": "thinking", "content": "text", "tool_call": "tool_use"}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessagesShape:
    """A generation's deltas as Messages content blocks and stream events. `model`: the name
    the client asked for (echoed); `clamped`: its `max_tokens` was lowered to what the
    context leaves, so reaching the limit is the context window's doing."""

    def __init__(self, gen: Generation, model: str, *, clamped: bool) -> None:
        self.gen, self.model, self.clamped = gen, model, clamped
        self.id = f"msg_{gen.id}"
        self.index = -1              # the current block's index
        self.open: str | None = None  # the current block's type, while it is open
        self.thinking = ""           # the open thinking block's text (its signature's input)

    # --- figures --------------------------------------------------------------------------

    def usage(self) -> MessagesUsage:
        gen = self.gen
        return MessagesUsage(input_tokens=len(gen.prompt) - gen.reuse_base,
                             output_tokens=gen.completion_tokens,
                             cache_creation_input_tokens=0,
                             cache_read_input_tokens=gen.reuse_base)

    def stop(self) -> StopDelta:
        """Why the message ended, in Anthropic's words."""
        gen = self.gen
        if gen.stops.hit:
            return StopDelta(stop_reason="stop_sequence", stop_sequence=gen.stops.fired)
        if gen.parser is not None and gen.parser.calls:  # whole calls, whatever came after
            return StopDelta(stop_reason="tool_use", stop_sequence=None)
        if gen.stop_reason == "context_limit" or (gen.stop_reason == "max_tokens"
                                                   and self.clamped):
            return StopDelta(stop_reason="model_context_window_exceeded", stop_sequence=None)
        if gen.stop_reason == "max_tokens":
            return StopDelta(stop_reason="max_tokens", stop_sequence=None)
        return StopDelta(stop_reason="end_turn", stop_sequence=None)

    # --- the whole message ------------------------------------------------------------------

    def body(self, deltas: list[Delta]) -> MessageBody:
        content: list = []
        for d in deltas:
            if d.kind == "tool_call":
                content.append(ToolUseContent(id=tool_use_id(d.call.id), name=d.call.name,
                                              input=json.loads(d.call.arguments)))
            elif content and content[-1].type == _BLOCK_OF[d.kind]:
                last = content[-1]
                content[-1] = (TextContent(text=last.text + d.text) if last.type == "text"
                               else ThinkingContent(thinking=last.thinking + d.text,
                                                    signature=""))
            else:
                content.append(TextContent(text=d.text) if d.kind == "content"
                               else ThinkingContent(thinking=d.text, signature=""))
        content = [ThinkingContent(thinking=c.thinking, signature=signature(c.thinking))
                   if c.type == "thinking" else c for c in content]
        stop = self.stop()
        return MessageBody(id=self.id, model=self.model, content=content,
                           stop_reason=stop.stop_reason, stop_sequence=stop.stop_sequence,
                           usage=self.usage())

    # --- the stream ---------------------------------------------------------------------------

    def message_start(self) -> bytes:
        return event(MessageStart(message=MessageBody(
            id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None,
            usage=self.usage())))

    def events(self, d: Delta) -> list[bytes]:
        """The events one delta makes: a new block where the kind changes."""
        kind = _BLOCK_OF[d.kind]
        out: list[bytes] = []
        if kind == "tool_use":
            call = d.call
            out += self._close()
            self.index += 1
            out.append(event(BlockStart(index=self.index, content_block=ToolUseContent(
                id=tool_use_id(call.id), name=call.name, input={}))))
            out.append(event(BlockDelta(index=self.index,
                                        delta=InputJsonDelta(partial_json=call.arguments))))
            out.append(event(BlockStop(index=self.index)))
            return out
        if self.open != kind:
            out += self._close()
            self.index += 1
            self.open = kind
            block = TextContent(text="") if kind == "text" else ThinkingContent(thinking="",
                                                                              signature="")
            out.append(event(BlockStart(index=self.index, content_block=block)))
        if kind == "thinking":
            self.thinking += d.text
            delta = ThinkingDelta(thinking=d.text)
        else:
            delta = TextDelta(text=d.text)
        out.append(event(BlockDelta(index=self.index, delta=delta)))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(event(BlockDelta(index=self.index, delta=SignatureDelta(
                signature=signature(self.thinking)))))
            self.thinking = ""
        out.append(event(BlockStop(index=self.index)))
        self.open = None
        return out

    def closing(self) -> list[bytes]:
        """The open block's end, `message_delta` and `message_stop`."""
        return [*self._close(), event(MessageDelta(delta=self.stop(), usage=self.usage())),
                event(MessageStop())]


class MessagesResponse(GenerationResponse):
    """A generation answered in the Messages API's grammar: the same response machinery
    (disconnect watching, waiting for the start, the whole body) with Anthropic's events
    and error envelope."""

    shape: MessagesShape

    async def _send_error(self, send, error: ApiError) -> None:
        body = json.dumps(error_body(error)).encode()
        extra = [(b"content-length", str(len(body)).encode())]
        if error.retry_after is not None:
            extra.append((b"retry-after", str(max(1, round(error.retry_after))).encode()))
        await self._start(send, error.status, "application/json", extra)
        await send({"type": "http.response.body", "body": body})

    async def _stream(self, send, gone) -> None:
        gen, shape = self.gen, self.shape
        deltas = await self._until_started(send, gone)
        if deltas is None:
            return
        await self._start(send, 200, "text/event-stream",
                          [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")])
        last_sent = time.monotonic()

        async def emit(events: list[bytes]) -> None:
            nonlocal last_sent
            if gone.is_set() or not events:
                return
            await send({"type": "http.response.body", "body": b"".join(events),
                        "more_body": True})
            last_sent = time.monotonic()

        await emit([shape.message_start()])
        for d in deltas:
            await emit(shape.events(d))
        keepalive = gen.server.settings.keepalive_s
        while gen.terminal is None and not gone.is_set():
            got = await gen.next_event(min(keepalive, 0.25))
            if got is not None:
                for d in gen.absorb(got):
                    await emit(shape.events(d))
            # checked after events too: a prefill's progress events come more often than
            # the wait's timeout, and send nothing
            if time.monotonic() - last_sent >= keepalive:
                await emit([event(Ping())])
        if gone.is_set():
            return
        if gen.succeeded:
            await emit(shape.closing())
        else:
            await emit([event(error_body(gen.failure()))])
        await send({"type": "http.response.body", "body": b"", "more_body": False})
