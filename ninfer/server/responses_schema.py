"""The Responses API's request (pydantic v2), read as `schemas` reads chat completions:
strict where a wrong value would silently change behaviour, unknown fields ignored, a known
field asking for what this server does not do refused with a 400 that says so.

Input items and content parts are discriminated by `type` (a message item may omit it); an
unknown type gets a 400 listing the supported ones. Tools other than `function`, `custom`
and `namespace` are read as `BuiltinTool`s, which the adapter drops."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictInt, StrictStr, Tag, field_validator

from .schemas import FunctionName, Temperature, _Model

ENCRYPTED_REASONING = "reasoning.encrypted_content"
# the discriminated unions' branch names, which a validation error's location holds (not
# `reasoning`: a request field has that name too)
TAGS = frozenset({"input_text", "output_text", "refusal", "input_image", "input_file",
                  "input_audio", "message", "function_call", "custom_tool_call",
                  "function_call_output", "custom_tool_call_output", "item_reference",
                  "function", "custom", "namespace", "unsupported"})
ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")]


def _refuse(kind: str, why: str):
    """A model for an input kind this server refuses, with the reason as its message."""

    class Refused(_Model):
        type: StrictStr

        @field_validator("type")
        @classmethod
        def _refused(cls, value: str) -> str:
            raise ValueError(f"{value!r}: {why}")

    Refused.__name__ = f"Refused_{kind}"
    return Refused


def _tagged(kinds: set[str], default: str | None = None):
    """A discriminator on `type` (`default` when absent); an unknown type is tagged
    `unsupported`."""

    def tag(value: Any) -> str | None:
        if not isinstance(value, dict):
            return None
        kind = value.get("type", default)
        return kind if kind in kinds else "unsupported"
    return Discriminator(tag)


# --- content parts ------------------------------------------------------------------------


class InputText(_Model):
    type: Literal["input_text"]
    text: StrictStr


class OutputTextPart(_Model):
    type: Literal["output_text"]
    text: StrictStr


class RefusalPart(_Model):
    type: Literal["refusal"]
    refusal: StrictStr


_NO_IMAGES = _refuse("media", "this server's models read text only (input_text parts)")
_UNKNOWN_PART = _refuse("part", "supported content parts: input_text, output_text, refusal")

ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[OutputTextPart, Tag("output_text")]
    | Annotated[RefusalPart, Tag("refusal")] | Annotated[_NO_IMAGES, Tag("input_image")]
    | Annotated[_NO_IMAGES, Tag("input_file")] | Annotated[_NO_IMAGES, Tag("input_audio")]
    | Annotated[_UNKNOWN_PART, Tag("unsupported")],
    _tagged({"input_text", "output_text", "refusal", "input_image", "input_file",
             "input_audio"})]


def text_of(content: str | list) -> str:
    """A message's or output's text: its string, or its parts' texts joined."""
    if isinstance(content, str):
        return content
    return "".join(p.refusal if isinstance(p, RefusalPart) else p.text for p in content)


# --- input items --------------------------------------------------------------------------


class MessageItem(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: StrictStr | list[ContentPart]


class FunctionCallItem(_Model):
    type: Literal["function_call"]
    call_id: StrictStr
    name: ToolName
    arguments: StrictStr
    namespace: StrictStr | None = None


class CustomToolCallItem(_Model):
    type: Literal["custom_tool_call"]
    call_id: StrictStr
    name: ToolName
    input: StrictStr
    namespace: StrictStr | None = None


class CallOutputItem(_Model):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: StrictStr
    output: StrictStr | list[ContentPart]


class SummaryPart(_Model):
    type: Literal["summary_text"]
    text: StrictStr


class ReasoningPart(_Model):
    type: Literal["reasoning_text"]
    text: StrictStr


class ReasoningItem(_Model):
    type: Literal["reasoning"]
    summary: list[SummaryPart] = []
    content: list[ReasoningPart] | None = None
    encrypted_content: StrictStr | None = None


_ITEM_KINDS = {"message", "function_call", "custom_tool_call", "function_call_output",
               "custom_tool_call_output", "reasoning", "item_reference"}
_NO_REFERENCES = _refuse("reference", "this server keeps no items: send the item itself")
_UNKNOWN_ITEM = _refuse("item", "supported input items: " + ", ".join(
    sorted(_ITEM_KINDS - {"item_reference"})))

InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CallOutputItem, Tag("function_call_output")]
    | Annotated[CallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[_NO_REFERENCES, Tag("item_reference")]
    | Annotated[_UNKNOWN_ITEM, Tag("unsupported")],
    _tagged(_ITEM_KINDS, default="message")]


# --- tools --------------------------------------------------------------------------------


class FunctionTool(_Model):
    type: Literal["function"]
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class CustomFormat(_Model):
    type: Literal["text", "grammar"]
    syntax: Literal["lark", "regex"] | None = None
    definition: StrictStr | None = None


class CustomTool(_Model):
    type: Literal["custom"]
    name: FunctionName
    description: StrictStr | None = None
    format: CustomFormat | None = None


class NamespaceTool(_Model):
    type: Literal["namespace"]
    name: FunctionName
    description: StrictStr = ""
    tools: list[Annotated[Annotated[FunctionTool, Tag("function")]
                          | Annotated[CustomTool, Tag("custom")],
                          _tagged({"function", "custom"})]]


class BuiltinTool(_Model):
    """A tool the provider runs (web search and the like): dropped, with a warning."""

    type: StrictStr


ToolDef = Annotated[
    Annotated[FunctionTool, Tag("function")] | Annotated[CustomTool, Tag("custom")]
    | Annotated[NamespaceTool, Tag("namespace")] | Annotated[BuiltinTool, Tag("unsupported")],
    _tagged({"function", "custom", "namespace"})]


class NamedTool(_Model):
    type: Literal["function", "custom"]
    name: ToolName


class AllowedTools(_Model):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]


# --- the request --------------------------------------------------------------------------


class ReasoningOptions(_Model):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormatOption(_Model):
    type: StrictStr

    @field_validator("type")
    @classmethod
    def _text_only(cls, value: str) -> str:
        if value != "text":
            raise ValueError(f"{value!r} is not supported: this server does not constrain its "
                             "output (only 'text')")
        return value


class TextOptions(_Model):
    format: TextFormatOption | None = None


Includable = Literal[
    "reasoning.encrypted_content", "message.output_text.logprobs",
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "code_interpreter_call.outputs"]


class ResponsesRequest(_Model):
    """`POST /v1/responses`. Unknown fields are ignored (`client_metadata`, `service_tier`,
    `stream_options`, ...); `cache_salt` is this server's own (the tenant's salt)."""

    model: StrictStr | None = None
    input: StrictStr | Annotated[list[InputItem], Field(min_length=1)]
    instructions: StrictStr | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | AllowedTools | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningOptions | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    stream: StrictBool = False
    store: StrictBool | None = None   # accepted, ignored: this server keeps no responses
    include: list[Includable] | None = None
    prompt_cache_key: Annotated[StrictStr, Field(max_length=1024)] | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    text: TextOptions | None = None
    truncation: Literal["disabled"] | None = None
    metadata: dict[StrictStr, StrictStr] | None = None
    user: StrictStr | None = None
    previous_response_id: StrictStr | None = None
    conversation: Any = None
    background: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=0)] | None = None
    max_tool_calls: None = None
    prompt: None = None

    @field_validator("previous_response_id", "conversation")
    @classmethod
    def _stateless(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("this server keeps no responses: send the whole conversation "
                             "in `input`")
        return value

    @field_validator("background")
    @classmethod
    def _foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("this server keeps no responses: background responses are "
                             "not supported")
        return value

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: str | list) -> str | list:
        if isinstance(value, str) and not value:
            raise ValueError("input is empty")
        return value

    @property
    def sealed_reasoning(self) -> bool:
        return ENCRYPTED_REASONING in (self.include or ())
