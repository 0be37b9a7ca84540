"""OpenAI request models (pydantic v2; the response bodies are in `bodies`). Requests are
validated strictly where a wrong value would silently change behaviour (types, ranges,
finiteness) and leniently where clients differ harmlessly (unknown fields are ignored). A
known field asking for what this server does not do (JSON-constrained output, a logit bias)
is refused, not ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)

Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Model):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Model):
    name: FunctionName
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(_Model):
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None

    @model_validator(mode="after")
    def _content_present(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (developer is system)."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": self.text()}
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class FunctionDef(_Model):
    name: FunctionName
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: dict[str, StrictStr]


class StreamOptions(_Model):
    include_usage: StrictBool = False


class ResponseFormat(_Model):
    """Plain text only: output constrained to JSON is not implemented, and a request for it
    ignored would hand the client what it did not ask for."""

    type: StrictStr

    @model_validator(mode="after")
    def _text_only(self) -> ResponseFormat:
        if self.type != "text":
            raise ValueError(f"type {self.type!r} is not supported: this server does not "
                             "constrain its output (only 'text')")
        return self


class SamplingFields(_Model):
    """Fields chat and text completions share."""

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Temperature | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    # not OpenAI's (vLLM's): logits of the prompt's and output's tokens divided (positive)
    # or multiplied (negative) by it; 1 for none
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] \
        | None = None
    seed: Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stop: StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]],
                                Field(max_length=4)] | None = None
    # not OpenAI's (vLLM's): more tokens that end the reply, and no stop at end-of-text
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]],
                              Field(max_length=64)] | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None  # (vLLM's) no stop before
    user: StrictStr | None = None
    session_id: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    # OpenAI's stable key for requests that share a prefix (the Codex CLI sends its
    # conversation's): a session key (server/sessions.py); empty is none
    prompt_cache_key: Annotated[StrictStr, Field(max_length=1024)] | None = None
    cache_salt: Annotated[StrictStr, Field(min_length=1, max_length=256)] | None = None
    logit_bias: dict[str, Any] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict | None) -> dict | None:
        if value:  # (an empty one changes nothing)
            raise ValueError("not supported: this server samples from the model's own "
                             "distribution")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(SamplingFields):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    functions: list[Any] | None = None  # the deprecated form of tools
    function_call: Any = None

    @field_validator("functions", "function_call")
    @classmethod
    def _tools_not_functions(cls, value: Any) -> Any:
        if value and value != "none":  # (none, or no functions, asks for nothing)
            raise ValueError("the deprecated function-calling fields are not supported: "
                             "send `tools` and `tool_choice`")
        return value

    @property
    def top_n(self) -> int | None:
        """Alternatives per token when log-probabilities are asked for, else None."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _tools_consistent(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tool function names must be unique")
        if isinstance(self.tool_choice, NamedToolChoice):
            if self.tool_choice.function.get("name") not in names:
                raise ValueError("tool_choice names a function that is not in tools")
        elif self.tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise ValueError("tool_choice needs tools")
        return self

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def enable_thinking(self) -> bool | None:
        """reasoning_effort 'none' turns thinking off; chat_template_kwargs may set it."""
        kwargs = self.chat_template_kwargs or {}
        if "enable_thinking" in kwargs:
            value = kwargs["enable_thinking"]
            if not isinstance(value, bool):
                raise ValueError("chat_template_kwargs.enable_thinking must be a boolean")
            return value
        if self.reasoning_effort is None:
            return None
        return self.reasoning_effort != "none"


Prompt = (StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=1)]
          | Annotated[list[StrictInt], Field(min_length=1)]
          | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]],
                      Field(min_length=1, max_length=1)])


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False
    suffix: None = None
    best_of: Annotated[StrictInt, Field(ge=1, le=1)] | None = None

    @property
    def top_n(self) -> int | None:
        return self.logprobs

