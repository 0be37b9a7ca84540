"""The one request type underneath every API.

Contract. Each API adapter (chat completions, text completions, responses, Anthropic's
messages) validates its body with its own pydantic model, converts it into one
`UnifiedRequest`, and hands that to `submission.start`, which renders it with the model's
chat template into token ids and submits it to the engine. Below the adapters nothing knows
which API was called: the same conversation sent through any of them renders to the same
token ids, gets the same session key and so reuses the same endpoints. The model's output is
parsed once (reasoning, content, tool calls: `parsing.OutputParser`) and each adapter shapes
those deltas in its own grammar.

Everything here is in the chat template's terms, not any API's:
- `messages`: `ChatMessage`s with roles `system`, `user`, `assistant`, `tool` (an API's
  `developer` is `system`). One assistant message is one model turn: its reasoning, its text
  and its tool calls, rendered in that order. A text completion has `prompt` (text or token
  ids, sent as is) instead.
- `tools`: function tools (`ToolSpec`); a tool of one free-text argument (the Responses API's
  `custom`) is a function whose one parameter is the string `input`.
- `reasoning`: the template's thinking switch (`enable_thinking`): True, False, or None for
  the template's default. `reasoning_budget`: the most reasoning tokens, None for no budget;
  the adapter resolves it (the request's own number, else its effort through the table in
  reasoning.py, else the server's `--reasoning-budget`), and the path underneath enforces it
  wherever the rendered prompt leaves a reasoning block open.
- `sampling`: what chooses tokens and ends the reply (`Sampling`).
- `answer`: the format the answer must match (`formats.AskedFormat`: a JSON schema, any JSON
  object, a regex, one of some strings, a Lark grammar) with the request field that asked
  for it, for a 400's `param`; None: free text. `logit_bias`: (token id, bias) pairs added
  to the logits. With the tool choice they are the reply's grammar (`formats.constrain`).
- `key_sources`: where the request names its conversation, after the `X-Session-Id` header
  that every API reads first (`sessions.KeySource`, in precedence order); `derive_key` lets
  the key be derived from the instructions and the first user message when none is named.
- `cache_salt`: with the API key, the tenant.
- `merge_system`: every system message is merged, in order, into one leading system message
  (for APIs whose instructions may come anywhere in the input); otherwise a system message
  after the first message is the template's to refuse.
- `pinned`: spans of the prompt whose token ids are known (the reasoning a client sends back
  in an opaque item): where a span's text occurs in the rendered prompt, it is encoded as
  those ids, so the prompt is the very ids the model computed on.

This module imports nothing of the server but the request schemas, the key source and the
effort table and the reading of chat and text completions' answer format (formats.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from .formats import AskedFormat, answer_format
from .reasoning import budget_for_effort
from .reply_grammar import InputGrammar
from .schemas import ChatRequest, CompletionRequest, SamplingFields
from .sessions import KeySource


class ToolCallRecord(NamedTuple):
    """A tool call an assistant turn made, as the template renders it."""

    id: str | None
    name: str
    arguments: str | dict[str, Any]   # text: rendered as written (the model's own text)


class ChatMessage(NamedTuple):
    role: str                          # system | user | assistant | tool
    content: str = ""
    reasoning: str | None = None       # an assistant turn's reasoning
    tool_calls: tuple[ToolCallRecord, ...] = ()
    tool_call_id: str | None = None    # a tool message: the call it answers
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template reads it (keys in the order chat completions
        has always passed them, so renders do not move)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ToolSpec(NamedTuple):
    """A function the model may call. `input`: its one string parameter's grammar (a
    Responses API custom tool's format), which holds every call of it."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None   # a JSON schema
    strict: bool | None = None
    input: InputGrammar | None = None

    def for_template(self) -> dict[str, Any]:
        """OpenAI's function-tool shape, None fields left out: what templates render."""
        fields = {"name": self.name, "description": self.description,
                  "parameters": self.parameters, "strict": self.strict}
        return {"type": "function",
                "function": {k: v for k, v in fields.items() if v is not None}}


class Sampling(NamedTuple):
    """How tokens are chosen and when the reply ends. None: the server's default."""

    max_tokens: int | None = None      # None: the server's default, capped by the context
    # with no max_tokens, the reply may run to the context's end (as OpenAI's Responses API
    # does) rather than stop at the server's --default-max-tokens
    open_ended: bool = False
    # a max_tokens larger than what the context leaves is lowered to fit rather than refused
    # (as Anthropic's API does: Claude Code asks for up to 64K)
    fit_to_context: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    seed: int | None = None
    top_n: int | None = None           # log-probability alternatives per token; None: none
    stop: tuple[str, ...] = ()         # stop strings
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


class PinnedText(NamedTuple):
    """A span of text whose token ids are known: `ids` decode to exactly `text`."""

    text: str
    ids: tuple[int, ...]


@dataclass(frozen=True)
class UnifiedRequest:
    """One request of any API, as the engine path underneath takes it (the module's
    docstring gives the contract of each field)."""

    route: str                               # the metrics' and log's name for the API
    model: str | None
    messages: tuple[ChatMessage, ...] = ()
    prompt: str | tuple[int, ...] | None = None   # a text completion's, instead of messages
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: str | None = None           # auto | none | required | a function's name
    parallel_tool_calls: bool | None = None
    reasoning: bool | None = None
    reasoning_budget: int | None = None
    sampling: Sampling = Sampling()
    answer: AskedFormat | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    key_sources: tuple[KeySource, ...] = ()
    derive_key: bool = False
    cache_salt: str | None = None
    merge_system: bool = False
    pinned: tuple[PinnedText, ...] = ()

    @property
    def chat(self) -> bool:
        """Rendered by the chat template (else a text completion, sent as is)."""
        return self.prompt is None

    @property
    def parses_tools(self) -> bool:
        """Tool-call markup in the output becomes tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def instructions(self) -> list[str]:
        """The system messages' texts, in order: one text when they are merged, so the same
        instructions split another way (an API's `instructions` and a developer message)
        name the same conversation."""
        texts = [m.content for m in self.messages if m.role == "system"]
        return ["\n\n".join(texts)] if self.merge_system and texts else texts

    def first_user(self) -> str | None:
        return next((m.content for m in self.messages if m.role == "user"), None)

    def template_messages(self) -> list[dict[str, Any]]:
        """The messages as the template reads them, system ones merged when asked."""
        messages = list(self.messages)
        if self.merge_system:
            system = self.instructions()
            rest = [m for m in messages if m.role != "system"]
            messages = [ChatMessage("system", text) for text in system] + rest
        return [m.for_template() for m in messages]

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.for_template() for t in self.tools] or None


# --- chat and text completions ------------------------------------------------------------


def sampling_of(body: SamplingFields, max_tokens: int | None, top_n: int | None) -> Sampling:
    """The sampling fields chat and text completions share."""
    return Sampling(
        max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=body.top_k, min_p=body.min_p, presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens, seed=body.seed, top_n=top_n, stop=body.stop_strings(),
        stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos)


def bias_pairs(body: SamplingFields) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias` (token ids as strings) as sorted (token id, bias) pairs."""
    return tuple(sorted((int(k), float(v)) for k, v in (body.logit_bias or {}).items()))


def openai_key_sources(body: SamplingFields) -> tuple[KeySource, ...]:
    """Chat and text completions name a conversation by `session_id`, then
    `prompt_cache_key` (after the header)."""
    return (KeySource("id", body.session_id), KeySource("cache", body.prompt_cache_key))


def from_chat(body: ChatRequest, *, default_budget: int | None) -> UnifiedRequest:
    """A chat completion request; `default_budget` is the server's reasoning budget, for a
    request whose `reasoning_effort` names none. Raises ValueError for a bad
    `chat_template_kwargs`, and ApiError (400) for output formats asked for twice or a
    schema that is not JSON."""
    messages = tuple(ChatMessage(
        role="system" if m.role == "developer" else m.role, content=m.text(),
        reasoning=m.reasoning_content,
        tool_calls=tuple(ToolCallRecord(c.id, c.function.name, c.function.arguments)
                         for c in m.tool_calls or ()),
        tool_call_id=m.tool_call_id, name=m.name) for m in body.messages)
    tools = tuple(ToolSpec(t.function.name, t.function.description, t.function.parameters,
                           t.function.strict) for t in body.tools or ())
    choice = body.tool_choice
    return UnifiedRequest(
        route="openai-chat", model=body.model, messages=messages, tools=tools,
        tool_choice=choice if isinstance(choice, str | None) else choice.function.get("name"),
        parallel_tool_calls=body.parallel_tool_calls, reasoning=body.enable_thinking(),
        reasoning_budget=budget_for_effort(body.reasoning_effort, default_budget),
        sampling=sampling_of(body, body.output_limit, body.top_n),
        answer=answer_format(body), logit_bias=bias_pairs(body),
        key_sources=openai_key_sources(body), derive_key=True, cache_salt=body.cache_salt)


def from_completion(body: CompletionRequest) -> UnifiedRequest:
    """A text completion request: the prompt as is (one text or one list of token ids).
    Raises ApiError (400) as `from_chat` does for its output format."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    return UnifiedRequest(
        route="openai-completion", model=body.model,
        prompt=prompt if isinstance(prompt, str) else tuple(prompt),
        sampling=sampling_of(body, body.max_tokens, body.top_n),
        answer=answer_format(body), logit_bias=bias_pairs(body),
        key_sources=openai_key_sources(body), cache_salt=body.cache_salt)
