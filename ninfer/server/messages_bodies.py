"""Anthropic's Messages API, the response bodies (pydantic v2): the message, a token count,
every stream event and the error envelope, strict and closed like bodies.py's (a wrong type
or an unknown field is a bug here). Written by the shape in messages_stream.py; described to
clients by openapi.py.

Usage as Anthropic counts it: `input_tokens` are the prompt tokens not read from the cache,
`cache_read_input_tokens` the ones reused (the plan's reuse base), nothing is billed as
cache creation."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, RootModel

from .bodies import Body
from .errors import ApiError

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


# --- errors -------------------------------------------------------------------------------------


class AnthropicErrorDetail(Body):
    type: str
    message: str


class AnthropicError(Body):
    """Anthropic's error envelope: the body of every error the Messages API answers, and the
    `error` event that ends a stream that failed."""

    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(error: ApiError) -> AnthropicError:
    """`error` in Anthropic's envelope. A 413 (and a 405) is an `invalid_request_error`: the
    `anthropic` package's error types have no other name for it."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500
                            else "invalid_request_error")
    return AnthropicError(error=AnthropicErrorDetail(type=kind, message=error.message))


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


StreamEvent = Annotated[MessageStart | BlockStart | BlockDelta | BlockStop | MessageDelta
                        | MessageStop | Ping, Field(discriminator="type")]


class MessagesStreamEvent(RootModel[StreamEvent]):
    """One event of a Messages API stream (its SSE `data:` line; the `event:` line names its
    `type`)."""
