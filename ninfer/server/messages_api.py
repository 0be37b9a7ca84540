"""Anthropic's Messages API, the request side: its request models (pydantic v2), the one
conversion of a Messages request into a chat request (`to_chat`: what chat completions hands
the rest of the server), its session key, and its error envelope.

Validated like the OpenAI requests (schemas.py): strictly where a wrong value would change
behaviour, leniently where clients differ harmlessly (unknown fields, `cache_control`
anywhere: reuse is automatic here). What this server cannot do is refused with a 400 that
says so (image and document content, continuing a final assistant message, structured
output); built-in tools it does not run (web search and the like) are dropped with one
warning line in the log.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Annotated, Any, Literal, NamedTuple

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from .errors import ApiError, bad_request
from .reasoning import budget_for_effort
from .schemas import ChatRequest
from .sessions import KeySource, chat_derived_key, header_source, session_key

log = logging.getLogger("ninfer.server")


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

    @property
    def built_in(self) -> bool:
        return self.type not in (None, "custom")


class ToolChoiceAuto(_Model):
    type: Literal["auto"]


class ToolChoiceAny(_Model):
    type: Literal["any"]


class ToolChoiceNone(_Model):
    type: Literal["none"]


class ToolChoiceTool(_Model):
    type: Literal["tool"]
    name: StrictStr


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


class OutputConfig(_Model):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None   # structured output: refused (see to_chat)


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


class ChatTurn(NamedTuple):
    """A Messages request as chat completions would have received it."""

    chat: ChatRequest
    reasoning_budget: int | None   # tokens of reasoning before the server closes it
    dropped_tools: tuple[str, ...]  # built-in tools this server does not run


def to_chat(body: MessagesRequest | CountTokensRequest, *, default_budget: int | None
            ) -> ChatTurn:
    """The one conversion: system prompt (the `system` field, then every system message in
    `messages`, in order) as one leading system message; user text, tool results (as tool
    messages), assistant text, thinking (as reasoning) and tool calls; client tools as
    functions; tool choice; thinking as the template's switch and a reasoning budget
    (reasoning.py); sampling fields. Raises the 400 for what cannot be served."""
    system, messages = _conversation(body)
    if system:
        messages.insert(0, {"role": "system", "content": "\n\n".join(system)})
    tools = [t for t in body.tools or () if not t.built_in]
    dropped = tuple(t.type or t.name for t in body.tools or () if t.built_in)
    for i, t in enumerate(body.tools or ()):
        if not t.built_in and t.input_schema is None:
            raise bad_request(f"tools.{i}.input_schema: a custom tool needs an input_schema",
                              f"tools.{i}.input_schema")
    enable, budget = _thinking(body, default_budget)
    data: dict[str, Any] = {
        "messages": messages, "chat_template_kwargs": {"enable_thinking": enable},
        "session_id": body.session_id, "cache_salt": body.cache_salt,
        "tools": [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in tools] or None,
        "tool_choice": _tool_choice(body.tool_choice, {t.name for t in tools}),
    }
    if isinstance(body, MessagesRequest):
        data.update(max_tokens=body.max_tokens, stream=body.stream, stop=body.stop_sequences,
                    temperature=body.temperature, top_p=body.top_p, top_k=body.top_k)
    if body.output_config is not None and body.output_config.format is not None:
        raise bad_request("output_config.format: structured output is not supported by this "
                          "server", "output_config.format")
    try:
        chat = ChatRequest.model_validate({k: v for k, v in data.items() if v is not None})
    except ValidationError as exc:  # a value Messages allows but chat completions does not
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        raise bad_request(f"this request cannot be served: {where}: {first['msg']}") from None
    return ChatTurn(chat, budget, dropped)


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


def _conversation(body: MessagesFields) -> tuple[list[str], list[dict]]:
    """The system prompt's parts and the chat messages, in order."""
    system: list[str] = []
    if isinstance(body.system, str):
        system.append(body.system)
    elif body.system:
        system.append("\n".join(b.text for b in body.system))
    out: list[dict] = []
    for i, message in enumerate(body.messages):
        where = f"messages.{i}.content"
        blocks = message.blocks()
        if message.role == "system":
            system.append(_text(blocks, where))
        elif message.role == "user":
            out.extend(_user(blocks, where))
        else:
            out.append(_assistant(blocks, where))
    if not out:
        raise bad_request("messages: at least one user message is needed", "messages")
    if out[-1]["role"] == "assistant":
        raise bad_request("messages: the last message must be the user's (continuing an "
                          "assistant message is not supported by this server)", "messages")
    return system, out


def _user(blocks: list, where: str) -> list[dict]:
    """A user message: its tool results as tool messages, its text as user messages, in
    the order they come."""
    out: list[dict] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ToolResultBlock):
            flush()
            content = b.content
            if isinstance(content, list):
                content = _text(content, f"{where}.{j}.content")
            out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content or ""})
        else:
            _refuse(b, f"{where}.{j}")
    flush()
    return out


def _assistant(blocks: list, where: str) -> dict:
    """An assistant message: text, thinking as reasoning (redacted thinking is dropped: this
    server cannot read it), tool calls."""
    text, reasoning, calls = [], [], []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(b.text)
        elif isinstance(b, ThinkingBlock):
            reasoning.append(b.thinking)
        elif isinstance(b, ToolUseBlock):
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": b.input}})
        elif not isinstance(b, RedactedThinkingBlock):
            _refuse(b, f"{where}.{j}")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_choice(choice, names: set[str]) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if choice.name not in names:
            raise bad_request(f"tool_choice: no tool named {choice.name!r} among the tools",
                              "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    if not names:
        if choice.type == "any":
            raise bad_request("tool_choice: 'any' needs tools", "tool_choice")
        return None
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _thinking(body: MessagesFields, default_budget: int | None) -> tuple[bool, int | None]:
    """The template's thinking switch and the reasoning budget. No `thinking` is thinking
    off, as on Anthropic's API; adaptive thinking takes its budget from the effort."""
    thinking = body.thinking
    if thinking is None or thinking.type == "disabled":
        return False, None
    if thinking.type == "enabled":
        return True, thinking.budget_tokens
    effort = body.output_config.effort if body.output_config else None
    return True, budget_for_effort(effort, default_budget)


# --- the session key -------------------------------------------------------------------------


def messages_session_key(headers, body: MessagesFields, chat: ChatRequest, *,
                         derive: bool) -> str | None:
    """The session key, first found (server/sessions.py): `X-Session-Id`, `session_id`,
    `metadata.user_id` (Claude Code puts its session there), then, unless turned off, the
    digest of the instructions and the first user message, as for a chat request."""
    user = body.metadata.user_id if body.metadata else None
    sources = [header_source(headers), KeySource("id", body.session_id),
               KeySource("user", user)]
    if derive:
        sources.append(KeySource("derived", chat_derived_key(chat)))
    return session_key(sources)


# --- errors -------------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 429: "rate_limit_error",
                500: "api_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(error: ApiError) -> dict:
    """Anthropic's error envelope. A 413 is an `invalid_request_error`: the `anthropic`
    package's error types have no other name for it."""
    kind = _ERROR_TYPES.get(error.status, "api_error" if error.status >= 500
                            else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: ApiError) -> JSONResponse:
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    return JSONResponse(error_body(error), status_code=error.status, headers=headers)


def signature(thinking: str) -> str:
    """A thinking block's `signature`: opaque to clients, a digest of the text here (this
    server reads thinking back as sent; it verifies nothing)."""
    return hashlib.blake2b(json.dumps(thinking).encode("utf-8", "surrogatepass"),
                           digest_size=16).hexdigest()
