"""Response bodies of chat and text completions, streamed chunks included (pydantic v2):
OpenAI's shapes, plus the extensions this server documents — llama.cpp's `timings` beside
`usage`, and `reasoning_content` in a message or a delta.

Models are strict and closed (a wrong type or an unknown field is a bug here, not the
client's input), and serialize to the same JSON as the OpenAI API: a field OpenAI always
sends is written even when null, an optional one (`reasoning_content`, `tool_calls`, the
delta's fields, a chunk's `usage`) only when it has a value. `wire(body)` is that JSON."""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

FinishReason = Literal["stop", "length", "tool_calls"]


def _absent(value: object) -> bool:
    return value is None


# on a field: written only when it has a value
OMITTED_IF_NONE = Field(exclude_if=_absent)


class Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


def wire(body: Body) -> str:
    """The body as JSON text, non-ASCII kept as is."""
    return json.dumps(body.model_dump(), ensure_ascii=False)


# --- usage and timings ------------------------------------------------------------------------


class PromptTokensDetails(Body):
    cached_tokens: int   # the plan's reuse base


class Usage(Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class Timings(Body):
    """llama.cpp's `timings`: cache_n + prompt_n = prompt tokens."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


# --- log-probabilities ------------------------------------------------------------------------


class TopLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]   # the token's own bytes (its text may have lost some to decoding)


class TokenLogprob(Body):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Body):
    content: list[TokenLogprob]


class TextLogprobs(Body):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


# --- chat completions -------------------------------------------------------------------------


class CalledFunction(Body):
    name: str
    arguments: str   # a JSON object as text


class MessageToolCall(Body):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class AssistantMessage(Body):
    role: Literal["assistant"] = "assistant"
    content: str | None       # None only beside tool calls
    reasoning_content: Annotated[str | None, OMITTED_IF_NONE] = None
    tool_calls: Annotated[list[MessageToolCall] | None, OMITTED_IF_NONE] = None


class ChatChoice(Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(Body):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    timings: Timings
    system_fingerprint: None = None


class DeltaToolCall(Body):
    index: int   # the call's position in the message; a call is sent whole, in one delta
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChunkDelta(Body):
    role: Annotated[Literal["assistant"] | None, OMITTED_IF_NONE] = None
    content: Annotated[str | None, OMITTED_IF_NONE] = None
    reasoning_content: Annotated[str | None, OMITTED_IF_NONE] = None
    tool_calls: Annotated[list[DeltaToolCall] | None, OMITTED_IF_NONE] = None


class ChunkChoice(Body):
    index: int
    delta: ChunkDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None   # in the finish chunk only


class ChatCompletionChunk(Body):
    """A streamed piece; the last one, when the client asked for usage, has no choices and
    carries `usage` and `timings`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Annotated[Usage | None, OMITTED_IF_NONE] = None
    timings: Annotated[Timings | None, OMITTED_IF_NONE] = None


# --- text completions -------------------------------------------------------------------------


class TextChoice(Body):
    index: int
    text: str
    logprobs: TextLogprobs | None
    finish_reason: FinishReason | None   # None in a streamed chunk before the last


class TextCompletion(Body):
    """A whole text completion (with `usage` and `timings`) or a streamed chunk of one
    (without them, but in the usage chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[TextChoice]
    usage: Annotated[Usage | None, OMITTED_IF_NONE] = None
    timings: Annotated[Timings | None, OMITTED_IF_NONE] = None


# --- the other routes -------------------------------------------------------------------------


class ModelCard(Body):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "ninfer"
    max_model_len: int   # vLLM's: the most tokens per request, prompt and output together


class ModelList(Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(Body):
    status: Literal["ok"] = "ok"


class Evicted(Body):
    evicted: int   # endpoints dropped
