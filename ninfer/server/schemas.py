"""OpenAI request models (pydantic v2; the response bodies are in `bodies`). Requests are
validated strictly where a wrong value would silently change behaviour (types, ranges,
finiteness) and leniently where clients differ harmlessly (unknown fields are ignored). A
known field asking for what this server does not do is refused, not ignored. The output
format fields (`response_format`, vLLM's `structured_outputs` and `guided_*`) are read into
a grammar by `formats`."""

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


class JsonSchemaFormat(_Model):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: StrictStr | None = None
    description: StrictStr | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object")
        return self


class StructuredOutputs(_Model):
    """vLLM's `structured_outputs`: exactly one of its formats."""

    json_: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None

    @model_validator(mode="after")
    def _one_format(self) -> StructuredOutputs:
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k)
                 is not None] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        return self


LogitBias = Annotated[dict[StrictStr, Annotated[float, Field(ge=-100.0, le=100.0,
                                                             allow_inf_nan=False)]],
                      Field(max_length=1024)]


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
    # OpenAI's: token id (as a string) -> a bias in [-100, 100] added to its logit
    logit_bias: LogitBias | None = None
    # what the output must match: OpenAI's response_format, vLLM's fields (formats.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: Annotated[list[StrictStr], Field(min_length=1)] | None = None
    guided_grammar: StrictStr | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict | None) -> dict | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
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

