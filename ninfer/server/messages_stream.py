"""Anthropic's Messages API, the response side: a generation's deltas (reasoning, text, tool
calls: server/parsing.py) as a message body and as the stream's event grammar, in the bodies
of messages_bodies.py. The response machinery (disconnect watching, waiting for the start,
the whole body) is streaming.py's `GenerationResponse`.

The stream: `message_start` (the message without content, usage with the prompt's
figures), then per content block `content_block_start`, its deltas (`thinking_delta` and a
`signature_delta` that closes each thinking block, `text_delta`, `input_json_delta` holding
a tool call's whole input as JSON), `content_block_stop`; then `message_delta` (stop reason,
the stop sequence that fired, usage) and `message_stop`. `ping` events keep the connection
alive while nothing else is sent (a long prompt prefilling). A failure after the stream
started is an `error` event; every error before it is Anthropic's envelope."""

from __future__ import annotations

import hashlib
import json

from .bodies import Body
from .errors import ApiError
from .generation import Generation
from .messages_bodies import (
    BlockDelta,
    BlockStart,
    BlockStop,
    InputJsonDelta,
    MessageBody,
    MessageDelta,
    MessageStart,
    MessageStop,
    MessagesUsage,
    Ping,
    SignatureDelta,
    StopDelta,
    TextContent,
    TextDelta,
    ThinkingContent,
    ThinkingDelta,
    ToolUseContent,
    anthropic_error,
)
from .parsing import Delta
from .streaming import StreamShape, TextEvents


def event(body: Body) -> bytes:
    """One server-sent event, named by the body's `type`."""
    data = body.model_dump()
    return f"event: {data['type']}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


def signature(thinking: str) -> str:
    """A thinking block's `signature`: opaque to clients, a digest of the text here (this
    server reads thinking back as sent; it verifies nothing)."""
    return hashlib.blake2b(json.dumps(thinking).encode("utf-8", "surrogatepass"),
                           digest_size=16).hexdigest()


_BLOCK_OF = {"reasoning": "thinking", "content": "text", "tool_call": "tool_use"}


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class MessagesShape(StreamShape):
    """A generation's deltas as Messages content blocks and stream events. `model`: the name
    the client asked for (echoed); `clamped`: its `max_tokens` was lowered to what the
    context leaves, so reaching the limit is the context window's doing."""

    def __init__(self, gen: Generation, model: str, *, clamped: bool) -> None:
        self.gen, self.model, self.clamped = gen, model, clamped
        self.id = f"msg_{gen.id}"
        self.index = -1              # the current block's index
        self.open: str | None = None  # the current block's type, while it is open
        self.thinking = ""           # the open thinking block's text (its signature's input)
        self._deltas: tuple[tuple[str, int], TextEvents] | None = None  # (kind, index)'s

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

    def opening(self) -> list[bytes]:
        return [event(MessageStart(message=MessageBody(
            id=self.id, model=self.model, content=[], stop_reason=None, stop_sequence=None,
            usage=self.usage())))]

    def on_delta(self, d: Delta) -> list[bytes]:
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
        out.append(self._delta_events(kind).event(d.text))
        return out

    def _delta_events(self, kind: str) -> TextEvents:
        """The open block's text or thinking deltas: its `content_block_delta` event made
        once with the mark for the text."""
        if self._deltas is None or self._deltas[0] != (kind, self.index):
            mark = TextEvents.MARK
            delta = ThinkingDelta(thinking=mark) if kind == "thinking" else TextDelta(text=mark)
            self._deltas = ((kind, self.index),
                            TextEvents(event(BlockDelta(index=self.index, delta=delta))))
        return self._deltas[1]

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

    def failing(self, error: ApiError) -> list[bytes]:
        return [event(anthropic_error(error))]

    def keepalive(self) -> bytes:
        return event(Ping())

    def error_body(self, error: ApiError) -> dict:
        return anthropic_error(error).model_dump()
