"""The responses of a generation: SSE events or one JSON body, in the grammar of the API
called (a `StreamShape`: chat and text completions' `Shape` here, the Responses API's in
responses_stream.py). Chat and text completions stream a role chunk, deltas, a finish chunk,
an optional usage chunk and `[DONE]`; every stream has keep-alive comments while nothing
else is sent.

Both watch the connection: a task awaits the ASGI `http.disconnect` message while the
response is produced, and the moment it arrives the engine request is cancelled (the engine
applies it at its next step boundary). Errors before the first byte are real HTTP statuses
(the stream waits for the request to start before sending headers); after it, an
OpenAI-shaped error event ends the stream."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from abc import ABC, abstractmethod

from starlette.responses import Response

from .bodies import (
    AssistantMessage,
    Body,
    CalledFunction,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatLogprobs,
    ChunkChoice,
    ChunkDelta,
    DeltaToolCall,
    FinishReason,
    MessageToolCall,
    TextChoice,
    TextCompletion,
    TextLogprobs,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
    wire,
)
from .errors import ApiError
from .generation import Generation
from .parsing import Delta, merged

log = logging.getLogger("ninfer.server")
_DRAINING: set[asyncio.Task] = set()


def sse(data: Body | dict | str) -> bytes:
    """One server-sent event: a body, an error object or `[DONE]`."""
    if isinstance(data, Body):
        text = wire(data)
    else:
        text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {text}\n\n".encode()


class TextEvents:
    """The SSE events of one body that differ only in one string (a stream's text deltas),
    byte for byte what the API's writer makes of the body: the template event, split once
    around the string, with each text's JSON spliced in. A token's event then costs one
    string's JSON, not pydantic models built, dumped and encoded (about a tenth of the
    time)."""

    MARK = "\x00"   # a template's text, which JSON writes as the escape "\u0000"
    # json.dumps(text, ensure_ascii=False), without the encoder dumps makes on each call
    # for an option off its default
    _string = json.JSONEncoder(ensure_ascii=False).encode

    def __init__(self, template: bytes) -> None:
        """`template`: the event of the body with MARK for the string, its last string
        (what comes before it, an id or a model's name, may hold anything)."""
        head, found, tail = template.decode().rpartition(json.dumps(self.MARK))
        if not found:
            raise ValueError("the template holds no mark")
        self.head, self.tail = head, tail

    def event(self, text: str) -> bytes:
        return (self.head + self._string(text) + self.tail).encode()


class StreamShape(ABC):
    """How one API writes a generation on the wire. A stream is `opening()`, then
    `on_delta(d)` for each delta, then `closing()` when the generation succeeded or
    `failing(error)` when it did not, each a list of SSE events, with `keepalive()` whenever
    nothing else was sent for the keep-alive interval; a whole body is `body(deltas)`, an
    error before the stream started `error_body(error)` (OpenAI's shape unless the API has
    its own). Created for one generation, used on the event loop's thread."""

    @abstractmethod
    def opening(self) -> list[bytes]:
        ...

    @abstractmethod
    def on_delta(self, d: Delta) -> list[bytes]:
        ...

    @abstractmethod
    def closing(self) -> list[bytes]:
        ...

    @abstractmethod
    def failing(self, error: ApiError) -> list[bytes]:
        ...

    @abstractmethod
    def body(self, deltas: list[Delta]) -> Body:
        ...

    def keepalive(self) -> bytes:
        return b": keep-alive\n\n"

    def error_body(self, error: ApiError) -> dict:
        return error.body()


class Shape(StreamShape):
    """How deltas look on the wire for one route (chat or text completions): the bodies of
    `bodies`, built from a generation's deltas and figures."""

    def __init__(self, gen: Generation, model: str, chat: bool, include_usage: bool,
                 top_n: int | None = None) -> None:
        self.gen, self.model, self.chat, self.include_usage = gen, model, chat, include_usage
        self.top_n = top_n   # alternatives per token; None: no log-probabilities
        prefix = "chatcmpl" if chat else "cmpl"
        self.id = f"{prefix}-{gen.id}"
        self.created = int(time.time())
        self.calls = 0
        self._text_events: dict[str, TextEvents] = {}   # by delta kind, made on first use

    def _chunk(self, choices: list, usage: Usage | None = None,
               timings: Timings | None = None) -> ChatCompletionChunk | TextCompletion:
        kind = ChatCompletionChunk if self.chat else TextCompletion
        return kind(id=self.id, created=self.created, model=self.model, choices=choices,
                    usage=usage, timings=timings)

    def _text(self, token: int) -> tuple[str, list[int]]:
        raw = self.gen.server.tokenizer.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def chat_logprobs(self, entries: list[dict]) -> ChatLogprobs | None:
        """Chat's logprobs object for committed tokens; None when not asked for."""
        if self.top_n is None:
            return None
        content = []
        for e in entries:
            text, raw = self._text(e["token"])
            top = []
            for token, lp in e["top"][:self.top_n]:
                t, b = self._text(token)
                top.append(TopLogprob(token=t, logprob=lp, bytes=b))
            content.append(TokenLogprob(token=text, logprob=e["logprob"], bytes=raw,
                                        top_logprobs=top))
        return ChatLogprobs(content=content)

    def text_logprobs(self, entries: list[dict]) -> TextLogprobs | None:
        """The text completion's logprobs object for committed tokens; None when not asked
        for."""
        if self.top_n is None:
            return None
        tokens = [self._text(e["token"])[0] for e in entries]
        offsets, at = [], 0
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return TextLogprobs(
            tokens=tokens, token_logprobs=[e["logprob"] for e in entries],
            top_logprobs=[{self._text(t)[0]: lp for t, lp in e["top"][:self.top_n]}
                          for e in entries], text_offset=offsets)

    def _unsent(self) -> list[dict]:
        """The log-probability entries a stream has not sent yet (marked sent)."""
        gen = self.gen
        entries = gen.logprobs[gen.logprobs_sent:]
        gen.logprobs_sent = len(gen.logprobs)
        return entries

    def _streamed(self, *, text: str = "", delta: ChunkDelta | None = None,
                  finish: FinishReason | None = None) -> ChatCompletionChunk | TextCompletion:
        """A chunk of one choice, `delta` (chat) or `text` (text completion), with the
        log-probabilities not sent yet."""
        entries = self._unsent()
        if self.chat:
            choice = ChunkChoice(index=0, delta=delta or ChunkDelta(),
                                 logprobs=self.chat_logprobs(entries), finish_reason=finish)
        else:
            choice = TextChoice(index=0, text=text, logprobs=self.text_logprobs(entries),
                                finish_reason=finish)
        return self._chunk([choice])

    def role_chunk(self) -> ChatCompletionChunk | None:
        if not self.chat:
            return None
        return self._chunk([ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""),
                                        logprobs=None, finish_reason=None)])

    def delta_chunk(self, d: Delta) -> ChatCompletionChunk | TextCompletion:
        if not self.chat:
            return self._streamed(text=d.text)
        if d.kind == "tool_call":
            call = d.call
            delta = ChunkDelta(tool_calls=[DeltaToolCall(
                index=self.calls, id=call.id,
                function=CalledFunction(name=call.name, arguments=call.arguments))])
            self.calls += 1
        elif d.kind == "reasoning":
            delta = ChunkDelta(reasoning_content=d.text)
        else:
            delta = ChunkDelta(content=d.text)
        return self._streamed(delta=delta)

    def finish_chunk(self) -> ChatCompletionChunk | TextCompletion:
        return self._streamed(finish=self.gen.finish_reason)

    def usage_chunk(self) -> ChatCompletionChunk | TextCompletion:
        return self._chunk([], usage=self.gen.usage(), timings=self.gen.timings())

    def opening(self) -> list[bytes]:
        role = self.role_chunk()
        return [] if role is None else [sse(role)]

    def on_delta(self, d: Delta) -> list[bytes]:
        if self.top_n is not None or d.kind == "tool_call":
            return [sse(self.delta_chunk(d))]
        events = self._text_events.get(d.kind)
        if events is None:  # delta_chunk's chunk of this kind, made once around the mark
            events = TextEvents(sse(self.delta_chunk(Delta(d.kind, TextEvents.MARK))))
            self._text_events[d.kind] = events
        self._unsent()  # as delta_chunk does: without log-probabilities, nothing to send
        return [events.event(d.text)]

    def closing(self) -> list[bytes]:
        out = [sse(self.finish_chunk())]
        if self.include_usage:
            out.append(sse(self.usage_chunk()))
        return [*out, sse("[DONE]")]

    def failing(self, error: ApiError) -> list[bytes]:
        return [sse(error.body()), sse("[DONE]")]

    def body(self, deltas: list[Delta]) -> ChatCompletion | TextCompletion:
        gen = self.gen
        if not self.chat:
            text = "".join(d.text for d in deltas)
            choice = TextChoice(index=0, text=text, logprobs=self.text_logprobs(gen.logprobs),
                                finish_reason=gen.finish_reason)
            return TextCompletion(id=self.id, created=self.created, model=self.model,
                                  choices=[choice], usage=gen.usage(), timings=gen.timings())
        content = "".join(d.text for d in deltas if d.kind == "content")
        reasoning = "".join(d.text for d in deltas if d.kind == "reasoning")
        calls = [MessageToolCall(id=d.call.id, function=CalledFunction(
                     name=d.call.name, arguments=d.call.arguments))
                 for d in deltas if d.kind == "tool_call"]
        message = AssistantMessage(content=content or (None if calls else ""),
                                   reasoning_content=reasoning or None, tool_calls=calls or None)
        choice = ChatChoice(index=0, message=message, logprobs=self.chat_logprobs(gen.logprobs),
                            finish_reason=gen.finish_reason)
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              choices=[choice], usage=gen.usage(), timings=gen.timings())


class GenerationResponse(Response):
    """An ASGI response that runs a submitted generation to its end."""

    def __init__(self, gen: Generation, shape: StreamShape, *, stream: bool) -> None:
        super().__init__()
        self.gen, self.shape, self.stream = gen, shape, stream
        self.status_sent: int | None = None

    async def __call__(self, scope, receive, send) -> None:
        gen = self.gen
        gone = asyncio.Event()

        async def watch() -> None:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    gen.cancel("disconnect")
                    gone.set()
                    return

        watcher = asyncio.create_task(watch())
        try:
            if self.stream:
                await self._stream(send, gone)
            else:
                await self._whole(send, gone)
        except OSError:  # the transport failed under a send: the client is gone
            gen.cancel("disconnect")
        except Exception:
            log.exception("req#%s: response failed", gen.id)
            gen.cancel("disconnect")
            if self.status_sent is None:
                await self._send_error(send, ApiError(500, "internal error",
                                                      code="internal_error"))
        finally:
            watcher.cancel()
            if gen.terminal is None:  # finish the bookkeeping off the response's path
                task = asyncio.get_running_loop().create_task(self._drain())
                _DRAINING.add(task)  # the loop keeps only weak references to tasks
                task.add_done_callback(_DRAINING.discard)
            else:
                gen.report(self.status_sent if gen.cancel_reason != "disconnect" else 499)

    async def _drain(self) -> None:
        await self.gen.run_to_end()
        self.gen.report(499 if self.gen.cancel_reason == "disconnect" else self.status_sent)

    async def _start(self, send, status: int, content_type: str,
                     extra: list[tuple[bytes, bytes]] = ()) -> None:
        headers = [(b"content-type", content_type.encode()),
                   (b"x-request-id", self.gen.id.encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        self.status_sent = status

    async def _send_error(self, send, error: ApiError) -> None:
        body = json.dumps(self.shape.error_body(error)).encode()
        extra = [(b"content-length", str(len(body)).encode())]
        if error.retry_after is not None:
            extra.append((b"retry-after", str(max(1, round(error.retry_after))).encode()))
        await self._start(send, error.status, "application/json", extra)
        await send({"type": "http.response.body", "body": body})

    async def _until_started(self, send, gone: asyncio.Event) -> list[Delta] | None:
        """Wait for the start (or the end); an error response if it never came."""
        wait = asyncio.create_task(self.gen.wait_started())
        lost = asyncio.create_task(gone.wait())
        try:
            done, _ = await asyncio.wait({wait, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if wait not in done:  # the client left while queued; the cancel is on its way
            wait.cancel()
            return None
        try:
            deltas = wait.result()
        except ApiError as error:
            await self._send_error(send, error)
            return None
        if self.gen.terminal is not None and not self.gen.succeeded:
            if self.gen.cancel_reason != "disconnect":
                await self._send_error(send, self.gen.failure())
            return None
        return deltas

    async def _whole(self, send, gone: asyncio.Event) -> None:
        gen = self.gen
        deltas = await self._until_started(send, gone)
        if deltas is None:
            return
        while gen.terminal is None and not gone.is_set():
            event = await gen.next_event(0.25)
            if event is not None:
                deltas += gen.absorb(event)
        if gone.is_set():
            return
        if not gen.succeeded:
            await self._send_error(send, gen.failure())
            return
        body = wire(self.shape.body(deltas)).encode()
        await self._start(send, 200, "application/json",
                          [(b"content-length", str(len(body)).encode())])
        await send({"type": "http.response.body", "body": body})

    def _events(self, deltas: list[Delta]) -> list[bytes]:
        return [data for d in deltas for data in self.shape.on_delta(d)]

    async def _stream(self, send, gone: asyncio.Event) -> None:
        gen, shape = self.gen, self.shape
        deltas = await self._until_started(send, gone)
        if deltas is None:
            return
        await self._start(send, 200, "text/event-stream",
                          [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")])
        self._last_sent = time.monotonic()

        async def emit(data: bytes) -> None:
            if gone.is_set() or not data:
                return
            await send({"type": "http.response.body", "body": data, "more_body": True})

        # each wake-up sends what it has in one body: the tokens ready together share one
        # event per kind (Generation.absorb_ready)
        await emit(b"".join([*shape.opening(), *self._events(merged(deltas))]))
        keepalive = self.gen.server.settings.keepalive_s
        while gen.terminal is None and not gone.is_set():
            event = await gen.next_event(min(keepalive, 0.25))
            if event is not None:
                data = self._events(gen.absorb_ready(event))
                if data:
                    await emit(b"".join(data))
                    self._last_sent = time.monotonic()
            # checked after events too: a prefill's progress events may come more often than
            # the wait's timeout, and they send nothing
            if time.monotonic() - self._last_sent >= keepalive:
                await emit(shape.keepalive())
                self._last_sent = time.monotonic()
        if gone.is_set():
            return
        await emit(b"".join(shape.closing() if gen.succeeded else shape.failing(gen.failure())))
        await send({"type": "http.response.body", "body": b"", "more_body": False})
