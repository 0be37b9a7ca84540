"""The one path underneath every API: a `UnifiedRequest` (unified.py) becomes token ids (the
chat template, the conversation's remembered ids, pinned spans), sampling parameters (the
reasoning budget among them, wherever the prompt leaves a reasoning block open; the reply's
grammar and logit bias: formats.py), a session key and a tenant, and is submitted to the
engine as a `Generation`. Adapters call `start`; what comes back is shaped by each API on its
own, and so are its errors (an adapter may reword them: `ContextExceeded` carries its
figures)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ..lifecycle.request import SamplingParams
from ..model.template import ChatTemplateError
from ..model.tokenizer import Tokenizer
from . import formats, reasoning, sessions
from .errors import ApiError, bad_request
from .generation import Generation, Settings
from .parsing import THINK_CLOSE, THINK_OPEN, OutputParser
from .reply_grammar import ToolCalls, ToolFormat
from .sessions import KeySource
from .unified import PinnedText, Sampling, UnifiedRequest

# a cold chat prompt of at least this many characters of messages is rendered and tokenized
# in a worker thread (the tokenizer lets go of the interpreter lock), so the event loop goes
# on streaming other requests' tokens meanwhile: a cold 32K-token conversation took ~25 ms
# of this machine's CPU. Below it the thread's hop costs more than the loop would wait.
RENDER_OFF_LOOP_CHARS = 20_000

if TYPE_CHECKING:
    from .app import Server


class Rendered(NamedTuple):
    """A chat rendered by the template."""

    text: str
    ids: list[int]
    boundaries: tuple[int, ...]   # message starts (the last few), where anchors may go
    shared: int                   # the end of the shared prefix (system prompt, tools); 0: none


class ContextExceeded(ApiError):
    """The prompt, or the prompt and the output limit asked for, do not fit the context: a
    400 `context_length_exceeded` in OpenAI's words, with the figures an adapter needs to say
    it in its own."""

    def __init__(self, prompt_len: int, max_context: int, asked: int | None = None) -> None:
        message = (f"this model's maximum context length is {max_context} tokens; the prompt "
                   f"has {prompt_len}")
        if asked is not None:
            message += f" and max_tokens asks for {asked}"
        super().__init__(400, message, param="messages" if asked is None else "max_tokens",
                         code="context_length_exceeded")
        self.prompt_len, self.max_context, self.asked = prompt_len, max_context, asked

    @property
    def longest_prompt(self) -> int:
        """The most prompt tokens the context takes (one output token must fit after)."""
        return self.max_context - 2


def check_model(server: Server, name: str | None) -> None:
    """The model's id and its `--model-alias` names are served; none named is the model."""
    settings = server.settings
    if name is not None and name != settings.model_id and name not in settings.model_aliases:
        raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                            f"{server.settings.model_id!r}", param="model",
                       code="model_not_found")


def check_ready(server: Server) -> None:
    if not server.ready or not server.alive:
        what = "the server failed to start" if server.failed else "the model is loading"
        if server.ready:
            what = "the engine stopped"
        raise ApiError(503, what, code="not_ready", retry_after=2)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as exc:  # e.g. lone surrogates the JSON allowed
        raise bad_request(f"text cannot be tokenized: {exc}") from None


def encode_head(tokenizer: Tokenizer, head: str, text: str, ids: Sequence[int]) -> list[int]:
    try:
        return tokenizer.encode_head(head, text, ids)
    except Exception as exc:  # (as `encode`: text the tokenizer refuses)
        raise bad_request(f"text cannot be tokenized: {exc}") from None


def pinned_encoder(encode_text: Callable[[str], list[int]], pinned: Sequence[PinnedText]
                   ) -> Callable[[str], list[int]]:
    """An `encode(text)` that encodes each pinned span, where its text occurs (in order,
    each after the last), as its known ids and the text around it as `encode_text` does.
    The ids decode to the same text, so the prompt reads the same either way."""
    if not pinned:
        return encode_text

    def encoded(text: str) -> list[int]:
        ids: list[int] = []
        at = 0
        for span in pinned:
            found = text.find(span.text, at) if span.text else -1
            if found < 0:
                continue
            if found > at:
                ids += encode_text(text[at:found])
            ids += span.ids
            at = found + len(span.text)
        if at < len(text):
            ids += encode_text(text[at:])
        return ids
    return encoded


def request_session_key(headers, request: UnifiedRequest, *, derive: bool) -> str | None:
    """The conversation's key: the `X-Session-Id` header, then the request's own sources,
    then (when both the server and the API allow it) the key derived from its instructions
    and first user message."""
    key = sessions.session_key([sessions.header_source(headers), *request.key_sources])
    if key is None and derive and request.derive_key:   # (a digest of the first message:
        # ~0.5 ms for a long one on a GPU machine's host, spent only where it is the key)
        key = sessions.session_key([KeySource("derived", sessions.derived_key(
            request.instructions(), request.first_user()))])
    return key


def stop_tokens(server: Server, sampling: Sampling) -> frozenset[int]:
    """The token ids that end a reply: the model's end-of-text ones (none with
    `ignore_eos`) and the request's `stop_token_ids`."""
    extra = frozenset(sampling.stop_token_ids)
    if any(t >= server.vocab_size for t in extra):
        raise bad_request(f"token ids must be in [0, {server.vocab_size})", "stop_token_ids")
    return extra | (frozenset() if sampling.ignore_eos else server.tokenizer.special.stop_ids)


def sampling_params(sampling: Sampling, prompt_len: int, settings: Settings,
                    stop_ids: frozenset[int]) -> SamplingParams:
    """The engine's parameters; `ContextExceeded` when the prompt (and the output limit asked
    for, unless the request lets it be lowered to fit) do not fit the context."""
    room = settings.max_context - prompt_len - 1
    limit = sampling.max_tokens
    if room < 1:
        raise ContextExceeded(prompt_len, settings.max_context)
    if limit is not None and limit > room:
        if not sampling.fit_to_context:
            raise ContextExceeded(prompt_len, settings.max_context, limit)
        limit = room
    default = room if sampling.open_ended else min(settings.default_max_tokens, room)
    max_tokens = limit if limit is not None else default
    if sampling.min_tokens and sampling.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({sampling.min_tokens}) is more than max_tokens "
                          f"({max_tokens})", "min_tokens")
    seed = None if sampling.seed is None else sampling.seed % 2**63
    return SamplingParams(
        max_tokens=max_tokens, stop_tokens=tuple(sorted(stop_ids)),
        temperature=sampling.temperature if sampling.temperature is not None else 1.0,
        top_p=sampling.top_p if sampling.top_p is not None else 1.0,
        top_k=max(sampling.top_k or 0, 0), min_p=sampling.min_p or 0.0,
        presence_penalty=sampling.presence_penalty or 0.0,
        frequency_penalty=sampling.frequency_penalty or 0.0,
        repetition_penalty=sampling.repetition_penalty or 1.0,
        min_tokens=sampling.min_tokens or 0, seed=seed,
        logprobs=0 if sampling.top_n is None else max(sampling.top_n, 1))


def render_chat(server: Server, request: UnifiedRequest,
                encode_text: Callable[[str], list[int]], plain: bool = False) -> Rendered:
    """The prompt text and ids, the message boundaries near its end and the end of its
    shared prefix. `plain`: `encode_text` is the tokenizer's own encoding (no pinned ids,
    no remembered conversation), so each boundary's head is encoded from the prompt's ids
    and its last part (`Tokenizer.encode_head`), not whole."""
    messages = request.template_messages()
    tools = request.template_tools()
    try:
        text = server.template.render(messages, tools=tools, add_generation_prompt=True,
                                      enable_thinking=request.reasoning)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    ids = encode_text(text)
    anchors = server.thread.engine.config.auto_anchors
    system = 1 if messages and messages[0]["role"] == "system" else 0
    # message starts, and the end of the last message (where the generation prompt starts:
    # a retry of the same messages resumes there)
    wanted = set(range(max(1, len(messages) + 1 - anchors), len(messages) + 1))
    if system or tools:
        wanted.add(system)
    offsets: dict[int, int] = {}
    for i in sorted(wanted):
        try:
            prefix = server.template.render(messages[:i], tools=tools,
                                            enable_thinking=request.reasoning)
        except ChatTemplateError:
            continue
        if not prefix or not text.startswith(prefix):
            continue
        head = encode_head(server.tokenizer, prefix, text, ids) if plain \
            else encode_text(prefix)
        if 0 < len(head) < len(ids) and ids[:len(head)] == head:
            offsets[i] = len(head)
    shared = offsets.get(system, 0) if (system or tools) else 0
    boundaries = tuple(sorted({b for i, b in offsets.items() if i >= 1}))
    return Rendered(text, ids, boundaries, shared)


def _message_chars(request: UnifiedRequest) -> int:
    return sum(len(m.content) + len(m.reasoning or "") for m in request.messages)


def opens_thinking(prompt: str) -> bool:
    """The generation prompt left a `<think>` block open: output starts as reasoning."""
    turn = prompt[prompt.rfind("<|im_start|>"):]
    return turn.rfind(THINK_OPEN) > turn.rfind(THINK_CLOSE)


def completion_ids(server: Server, prompt: str | tuple[int, ...]) -> list[int]:
    """A text completion's prompt as token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        return encode(server.tokenizer, prompt)
    if any(not 0 <= t < server.vocab_size for t in prompt):
        raise bad_request(f"token ids must be in [0, {server.vocab_size})", "prompt")
    return list(prompt)


def request_tool_calls(request: UnifiedRequest) -> ToolCalls | None:
    """The tool calls the request's tool choice asks for (formats.tool_calls)."""
    tools = [ToolFormat(t.name, t.parameters, bool(t.strict), t.input) for t in request.tools]
    return formats.tool_calls(tools, request.tool_choice, request.parallel_tool_calls)


async def start(server: Server, request: UnifiedRequest, *, headers, api_key: str | None,
                arrival: float) -> Generation:
    """Render, check, constrain and submit one request; raises ApiError for what is wrong
    with it (nothing is queued then). Its grammar compiles in a worker thread."""
    check_model(server, request.model)
    stop_ids = stop_tokens(server, request.sampling)
    session = request_session_key(headers, request,
                                  derive=server.settings.derive_session_keys)
    tenant = sessions.tenant(api_key, request.cache_salt)
    text, thinking = None, False
    if request.chat:
        base = pinned_encoder(lambda t: encode(server.tokenizer, t), request.pinned)
        encode_text = server.history.encoder(base, tenant, session)
        plain = encode_text is base and not request.pinned
        if plain and _message_chars(request) >= RENDER_OFF_LOOP_CHARS:
            # (no remembered conversation is read or moved: the worker touches only the
            # tokenizer and the template)
            rendered = await asyncio.to_thread(render_chat, server, request, encode_text, True)
        else:
            rendered = render_chat(server, request, encode_text, plain=plain)
        text, ids, boundaries, shared = rendered
        thinking = opens_thinking(text)
        parser = OutputParser(thinking=thinking, tools=request.parses_tools)
    else:
        ids, boundaries, shared, parser = completion_ids(server, request.prompt), (), 0, None
    params = sampling_params(request.sampling, len(ids), server.settings, stop_ids)
    if thinking:
        params = reasoning.bounded(params, request.reasoning_budget, server.tokenizer)
    open_limit = request.sampling.max_tokens is None
    params = await formats.constrain(
        server, params, answer=request.answer,
        calls=request_tool_calls(request) if request.chat else None,
        bias=request.logit_bias, reasoning=thinking,
        room=server.settings.max_context - len(ids) - 1 if open_limit else None)
    gen = Generation(server, route=request.route, prompt=tuple(ids), session=session,
                     tenant=tenant, params=params, prompt_text=text, boundaries=boundaries,
                     shared_prefix=shared,
                     # a constrained reply is its grammar's: stop strings do not cut it
                     stops=request.sampling.stop if params.grammar is None else (),
                     parser=parser, arrival=arrival)
    gen.submit()
    return gen
