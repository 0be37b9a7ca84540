"""Anthropic's Messages API, the request side: its request models (pydantic v2) and the one
conversion of a Messages request into the request type underneath every API
(`to_unified`: unified.py), which the routes (messages_routes.py) start on the path
underneath (submission.py) as chat completions and responses do.

Validated like the OpenAI requests (schemas.py): strictly where a wrong value would change
behaviour, leniently where clients differ harmlessly (unknown fields, `cache_control`
anywhere: reuse is automatic here). What this server cannot do is refused with a 400 that
says so (image and document content, continuing a final assistant message); built-in tools
it does not run (web search and the like) are dropped with one warning line in the log.

Constrained output, as on the other APIs (formats.py): `output_config.format` (a JSON
schema) holds the answer to it, `tool_choice` `any` and `tool` force well-formed calls (one
with `disable_parallel_tool_use`), and a `strict` tool's input is held to its schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from .errors import bad_request
from .formats import AskedFormat
from .reasoning import budget_for_effort
from .reply_grammar import OutputFormat
from .sessions import KeySource
from .unified import ChatMessage, Sampling, ToolCallRecord, ToolSpec, UnifiedRequest

ROUTE = "anthropic-messages"


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# --- content blocks -------------------------------------------------------------------------


class TextBlock(_Model):
    type: Literal["text"]
    text: StrictStr


class ImageBlock(_Model):
    type: Literal["image"]


class DocumentBlock(_Model):
    type: Literal["document"]


class ToolUseBlock(_Model):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any]


class ToolResultBlock(_Model):
    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[Annotated[TextBlock | ImageBlock | DocumentBlock,
                                        Field(discriminator="type")]] | None = None
    is_error: StrictBool | None = None


class ThinkingBlock(_Model):
    type: Literal["thinking"]
    thinking: StrictStr
    signature: StrictStr | None = None


class RedactedThinkingBlock(_Model):
    type: Literal["redacted_thinking"]
    data: StrictStr | None = None


Block = Annotated[TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock
                  | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")]


class InputMessage(_Model):
    # "system": a system message in the middle of the conversation (Claude Code sends some)
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[Block]

    def blocks(self) -> list:
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return self.content


# --- tools, thinking, the request --------------------------------------------------------


class ToolDef(_Model):
    """A client tool (`type` absent or "custom", with its `input_schema`), or a built-in
    one (any other `type`: web search, bash, text editor, ...), which this server drops."""

    name: Annotated[StrictStr, Field(min_length=1, max_length=128)]
    type: StrictStr | None = None
    description: StrictStr | None = None
    input_schema: dict[str, Any] | None = None
    strict: StrictBool | None = None   # its input held to input_schema

    @property
    def built_in(self) -> bool:
        return self.type not in (None, "custom")


class ToolChoiceAuto(_Model):
    type: Literal["auto"]
    disable_parallel_tool_use: StrictBool | None = None


class ToolChoiceAny(_Model):
    type: Literal["any"]
    disable_parallel_tool_use: StrictBool | None = None


class ToolChoiceNone(_Model):
    type: Literal["none"]


class ToolChoiceTool(_Model):
    type: Literal["tool"]
    name: StrictStr
    disable_parallel_tool_use: StrictBool | None = None


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceNone | ToolChoiceTool,
                       Field(discriminator="type")]


class ThinkingEnabled(_Model):
    type: Literal["enabled"]
    # Anthropic asks for at least 1,024; smaller budgets are served here as asked
    budget_tokens: Annotated[StrictInt, Field(ge=0)]


class ThinkingDisabled(_Model):
    type: Literal["disabled"]


class ThinkingAdaptive(_Model):
    type: Literal["adaptive"]


Thinking = Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive,
                     Field(discriminator="type")]


class JsonOutputFormat(_Model):
    """The answer held to a JSON schema (any JSON whitespace: Anthropic's format has no
    `strict`)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class Metadata(_Model):
    user_id: Annotated[StrictStr, Field(max_length=512)] | None = None


class MessagesFields(_Model):
    """What a message and a token count share."""

    model: StrictStr
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: StrictStr | list[TextBlock] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    metadata: Metadata | None = None
    # this server's, as on chat completions: a session key and a cache salt (the tenant)
    session_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None


class MessagesRequest(MessagesFields):
    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stream: StrictBool = False
    stop_sequences: list[Annotated[StrictStr, Field(min_length=1)]] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None


class CountTokensRequest(MessagesFields):
    pass


# --- the conversion ----------------------------------------------------------------------------


class MessagesTurn(NamedTuple):
    """A Messages request in the request type underneath."""

    request: UnifiedRequest
    dropped_tools: tuple[str, ...]  # built-in tools this server does not run


def to_unified(body: MessagesRequest | CountTokensRequest, *, default_budget: int | None
               ) -> MessagesTurn:
    """The one conversion: the system prompt (the `system` field, then every system message
    in `messages`, in order) merged into one leading system message; user text, tool results
    (as tool messages), assistant text, thinking (as reasoning) and tool calls; client tools
    as functions; tool choice; thinking as the template's switch and a reasoning budget
    (reasoning.py; `default_budget` is the server's); sampling fields (a token count has
    none); the session key's sources (`session_id`, then `metadata.user_id`, where Claude
    Code puts its session; else derived) and the cache salt. Raises the 400 for what cannot
    be served.

    The model's name is the routes' to check (any `claude-*` name is the Messages API's
    own), so the request underneath names none."""
    messages = _conversation(body)
    for i, t in enumerate(body.tools or ()):
        if not t.built_in and t.input_schema is None:
            raise bad_request(f"tools.{i}.input_schema: a custom tool needs an input_schema",
                              f"tools.{i}.input_schema")
    tools = tuple(ToolSpec(t.name, t.description, t.input_schema, t.strict)
                  for t in body.tools or () if not t.built_in)
    dropped = tuple(t.type or t.name for t in body.tools or () if t.built_in)
    enable, budget = _thinking(body, default_budget)
    sampling = Sampling()
    if isinstance(body, MessagesRequest):
        sampling = Sampling(max_tokens=body.max_tokens, fit_to_context=True,
                            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                            stop=tuple(body.stop_sequences or ()))
    user = body.metadata.user_id if body.metadata else None
    request = UnifiedRequest(
        route=ROUTE, model=None, messages=messages, tools=tools,
        tool_choice=_tool_choice(body.tool_choice, {t.name for t in tools}),
        parallel_tool_calls=_parallel(body.tool_choice),
        reasoning=enable, reasoning_budget=budget, sampling=sampling, answer=_answer(body),
        key_sources=(KeySource("id", body.session_id), KeySource("user", user)),
        derive_key=True, cache_salt=body.cache_salt, merge_system=True)
    return MessagesTurn(request, dropped)


def _text(blocks: list, where: str) -> str:
    """Text blocks' text, joined; a 400 for any other block."""
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlock):
            _refuse(b, f"{where}.{j}")
    return "".join(b.text for b in blocks)


def _refuse(block, where: str) -> None:
    if isinstance(block, ImageBlock | DocumentBlock):
        raise bad_request(f"{where}: {block.type} content is not supported by this server "
                          "yet (text only)", where)
    raise bad_request(f"{where}: a {block.type} block cannot stand here", where)


def _conversation(body: MessagesFields) -> tuple[ChatMessage, ...]:
    """The chat messages, in order; the system prompt's parts are system messages where
    they stand (the request merges them into one leading system message)."""
    out: list[ChatMessage] = []
    if isinstance(body.system, str):
        out.append(ChatMessage("system", body.system))
    elif body.system:
        out.append(ChatMessage("system", "\n".join(b.text for b in body.system)))
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        blocks = message.blocks()
        if message.role == "system":
            out.append(ChatMessage("system", _text(blocks, where)))
        elif message.role == "user":
            out.extend(_user(blocks, where))
        else:
            out.append(_assistant(blocks, where))
    turns = [m for m in out if m.role != "system"]
    if not turns:
        raise bad_request("messages: at least one user message is needed", "messages")
    if turns[-1].role == "assistant":
        raise bad_request("messages: the last message must be the user's (continuing an "
                          "assistant message is not supported by this server)", "messages")
    return tuple(out)


def _user(blocks: list, where: str) -> list[ChatMessage]:
    """A user message: its tool results as tool messages, its text as user messages, in
    the order they come."""
    out: list[ChatMessage] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append(ChatMessage("user", "".join(text)))
            text.clear()

    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolResultBlock):
            flush()
            content = b.content
            if isinstance(content, list):
                content = _text(content, f"{where}.{j}.content")
            out.append(ChatMessage("tool", content or "", tool_call_id=b.tool_use_id))
        else:
            _refuse(b, f"{where}.{j}")
    flush()
    return out


def _assistant(blocks: list, where: str) -> ChatMessage:
    """An assistant message, one model turn: text, thinking as reasoning (redacted thinking
    is dropped: this server cannot read it), tool calls."""
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append(ToolCallRecord(b.id, b.name, b.input))
        elif not isinstance(b, RedactedThinkingBlock):
            _refuse(b, f"{where}.{j}")
    return ChatMessage("assistant", "".join(text),
                       reasoning="".join(reasoning) if reasoning else None,
                       tool_calls=tuple(calls))


def _tool_choice(choice, names: set[str]) -> str | None:
    """Anthropic's tool choice in the request type's terms: auto, none, required or the
    name of the one tool to call."""
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name not in names:
            raise bad_request(f"tool_choice: no tool named {choice.name!r} among the tools",
                              "tool_choice.name")
        return choice.name
    if not names:
        if choice.type == "any":
            raise bad_request("tool_choice: 'any' needs tools", "tool_choice")
        return None
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _parallel(choice) -> bool | None:
    """Anthropic's `disable_parallel_tool_use` as the request type's parallel_tool_calls."""
    if choice is None or isinstance(choice, ToolChoiceNone) \
            or choice.disable_parallel_tool_use is None:
        return None
    return not choice.disable_parallel_tool_use


def _answer(body: MessagesFields) -> AskedFormat | None:
    """`output_config.format` as the answer's format (None: free text)."""
    fmt = body.output_config.format if body.output_config is not None else None
    if fmt is None:
        return None
    return AskedFormat(OutputFormat("json_schema", fmt.schema_), "output_config.format")


def _thinking(body: MessagesFields, default_budget: int | None) -> tuple[bool, int | None]:
    """The template's thinking switch and the reasoning budget. No `thinking` is thinking
    off, as on Anthropic's API; adaptive thinking takes its budget from the effort, else the
    server's default."""
    thinking = body.thinking
    if thinking is None or thinking.type == "disabled":
        return False, None
    if thinking.type == "enabled":
        return True, thinking.budget_tokens
    effort = body.output_config.effort if body.output_config else None
    return True, budget_for_effort(effort, default_budget)
