"""Bodies of the OpenAI Responses API (pydantic v2): the response object, its output items
and the stream's events, as `bodies` does for chat completions (strict, closed models;
`wire(body)` is the JSON, a field written only when it has a value where so marked).

This server's departures, each documented where it is used: `store` is not echoed (nothing
is stored), `usage.input_tokens_details.cache_write_tokens` is always 0 (cache writes are not
counted separately: every prompt the engine computes is kept for its conversation's next
turn), and a reasoning item carries its text in `content` and no summary."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field

from .bodies import OMITTED_IF_NONE, Body

ItemStatus = Literal["in_progress", "completed", "incomplete"]
ResponseStatus = Literal["in_progress", "completed", "incomplete", "failed"]


# --- usage --------------------------------------------------------------------------------


class InputTokensDetails(Body):
    cached_tokens: int          # the plan's reuse base
    cache_write_tokens: int = 0


class OutputTokensDetails(Body):
    reasoning_tokens: int       # output tokens up to the end of the reasoning block


class ResponseUsage(Body):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


# --- output items -------------------------------------------------------------------------


class ReasoningText(Body):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class SummaryText(Body):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ReasoningItem(Body):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[SummaryText] = []
    content: list[ReasoningText]
    # with include ["reasoning.encrypted_content"]: the reasoning and its token ids, sealed
    encrypted_content: Annotated[str | None, OMITTED_IF_NONE] = None
    status: ItemStatus


class OutputText(Body):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] = []


class MessageItem(Body):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus
    content: list[OutputText]


class FunctionCallItem(Body):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str              # a JSON object as text
    namespace: Annotated[str | None, OMITTED_IF_NONE] = None
    status: ItemStatus


class CustomToolCallItem(Body):
    id: str
    type: Literal["custom_tool_call"] = "custom_tool_call"
    call_id: str
    name: str
    input: str
    namespace: Annotated[str | None, OMITTED_IF_NONE] = None


OutputItem = Annotated[ReasoningItem | MessageItem | FunctionCallItem | CustomToolCallItem,
                       Field(discriminator="type")]


# --- the response object ------------------------------------------------------------------


class ResponseError(Body):
    code: str                   # context_length_exceeded | server_error | rate_limit_exceeded
    message: str


class IncompleteDetails(Body):
    reason: Literal["max_output_tokens"]


class ReasoningEcho(Body):
    effort: str | None
    summary: str | None


class FunctionToolEcho(Body):
    type: Literal["function"] = "function"
    name: str
    description: Annotated[str | None, OMITTED_IF_NONE] = None
    parameters: dict[str, Any] | None
    strict: bool | None


class CustomToolEcho(Body):
    type: Literal["custom"] = "custom"
    name: str
    description: Annotated[str | None, OMITTED_IF_NONE] = None
    format: Annotated[dict[str, Any] | None, OMITTED_IF_NONE] = None


class NamespaceToolEcho(Body):
    type: Literal["namespace"] = "namespace"
    name: str
    description: str
    tools: list[FunctionToolEcho | CustomToolEcho]


ToolEcho = Annotated[FunctionToolEcho | CustomToolEcho | NamespaceToolEcho,
                     Field(discriminator="type")]


class NamedToolChoice(Body):
    type: Literal["function", "custom"]
    name: str


class TextFormat(Body):
    type: Literal["text"] = "text"


class TextOptions(Body):
    format: TextFormat = TextFormat()


class ResponseObject(Body):
    """A response: whole (`POST /v1/responses` without `stream`), or the state a stream's
    lifecycle event carries."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    prompt_cache_key: Annotated[str | None, OMITTED_IF_NONE] = None
    reasoning: ReasoningEcho
    temperature: float | None
    text: TextOptions = TextOptions()
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice
    tools: list[ToolEcho]
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = {}


# --- stream events ------------------------------------------------------------------------


class ResponseCreated(Body):
    type: Literal["response.created"] = "response.created"
    sequence_number: int
    response: ResponseObject


class ResponseInProgress(Body):
    type: Literal["response.in_progress"] = "response.in_progress"
    sequence_number: int
    response: ResponseObject


class ResponseCompleted(Body):
    type: Literal["response.completed"] = "response.completed"
    sequence_number: int
    response: ResponseObject


class ResponseIncomplete(Body):
    type: Literal["response.incomplete"] = "response.incomplete"
    sequence_number: int
    response: ResponseObject


class ResponseFailed(Body):
    type: Literal["response.failed"] = "response.failed"
    sequence_number: int
    response: ResponseObject


class OutputItemAdded(Body):
    type: Literal["response.output_item.added"] = "response.output_item.added"
    sequence_number: int
    output_index: int
    item: OutputItem


class OutputItemDone(Body):
    type: Literal["response.output_item.done"] = "response.output_item.done"
    sequence_number: int
    output_index: int
    item: OutputItem


ContentPart = Annotated[OutputText | ReasoningText, Field(discriminator="type")]


class ContentPartAdded(Body):
    type: Literal["response.content_part.added"] = "response.content_part.added"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class ContentPartDone(Body):
    type: Literal["response.content_part.done"] = "response.content_part.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class OutputTextDelta(Body):
    type: Literal["response.output_text.delta"] = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] = []


class OutputTextDone(Body):
    type: Literal["response.output_text.done"] = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] = []


class ReasoningTextDelta(Body):
    type: Literal["response.reasoning_text.delta"] = "response.reasoning_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(Body):
    type: Literal["response.reasoning_text.done"] = "response.reasoning_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(Body):
    type: Literal["response.function_call_arguments.delta"] = \
        "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(Body):
    type: Literal["response.function_call_arguments.done"] = \
        "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    arguments: str


class CustomToolCallInputDelta(Body):
    type: Literal["response.custom_tool_call_input.delta"] = \
        "response.custom_tool_call_input.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class CustomToolCallInputDone(Body):
    type: Literal["response.custom_tool_call_input.done"] = \
        "response.custom_tool_call_input.done"
    sequence_number: int
    item_id: str
    output_index: int
    input: str


StreamEvent = Annotated[
    ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete
    | ResponseFailed | OutputItemAdded | OutputItemDone | ContentPartAdded | ContentPartDone
    | OutputTextDelta | OutputTextDone | ReasoningTextDelta | ReasoningTextDone
    | FunctionCallArgumentsDelta | FunctionCallArgumentsDone | CustomToolCallInputDelta
    | CustomToolCallInputDone, Field(discriminator="type")]
