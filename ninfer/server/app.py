"""The FastAPI app: routes, request reading (content type, size, UTF-8, JSON), rendering
chats into token ids with message boundaries, and the server's shared state."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from ..engine.thread import EngineThread
from ..lifecycle.request import SamplingParams
from ..model.template import ChatTemplate, ChatTemplateError
from ..model.tokenizer import Tokenizer
from . import errors, reasoning, sessions
from .errors import ApiError, bad_request
from .generation import Generation, Settings
from .history import History
from .metrics import CONTENT_TYPE, EngineFigures, Metrics, engine_snapshot
from .parsing import THINK_CLOSE, THINK_OPEN, OutputParser
from .schemas import ChatRequest, CompletionRequest, SamplingFields
from .streaming import GenerationResponse, Shape

log = logging.getLogger("ninfer.server")


class Server:
    """What the routes share: the engine thread, tokenizer, template, options, metrics.
    The engine side is attached once loaded; until then (and until warmed) the server
    answers 503 with Retry-After."""

    def __init__(self, settings: Settings, thread: EngineThread | None = None,
                 tokenizer: Tokenizer | None = None, template: ChatTemplate | None = None):
        self.settings = settings
        self.metrics = Metrics()
        self.ready = False
        self.failed = False
        self.boot = secrets.token_hex(3)
        self._ids = itertools.count(1)
        self.thread: EngineThread | None = None
        self.history = History()
        if thread is not None:
            self.attach(thread, tokenizer, template)

    def attach(self, thread: EngineThread, tokenizer: Tokenizer, template: ChatTemplate) -> None:
        self.thread, self.tokenizer, self.template = thread, tokenizer, template
        thread.on_cancel_latency = self.metrics.cancelled

    def next_request_id(self) -> str:
        return f"{self.boot}-{next(self._ids)}"

    @property
    def vocab_size(self) -> int:
        return self.thread.engine.model.vocab_size

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.alive


class _ClientGone(Exception):
    """The client left while its body was being read."""


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, or the 400/413 that says what is wrong with it."""
    ctype = request.headers.get("content-type", "")
    if ctype.split(";")[0].strip().lower() != "application/json":
        raise ApiError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                       code="invalid_content_type")
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body over {limit:,} bytes", code="request_too_large")
    raw = bytearray()
    try:
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > limit:
                raise ApiError(413, f"request body over {limit:,} bytes",
                               code="request_too_large")
    except ClientDisconnect as exc:
        raise _ClientGone() from exc
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start})") from None

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        data = json.loads(text, parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"malformed JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return data


def validate(model: type, data: dict):
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # in a union, the branch whose type matched says more than the ones that did not
        ranked = sorted(exc.errors(include_url=False),
                        key=lambda e: (e["type"].endswith("_type"), -len(_field_path(e["loc"]))))
        first = ranked[0]
        param = ".".join(str(p) for p in _field_path(first["loc"])) or None
        message = first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {message}" if param else message, param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple) -> tuple:
    """A pydantic location without its union-branch tags (`str`, `list[str]`, ...)."""
    return tuple(p for p in loc if isinstance(p, int) or (
        p not in _TYPE_TAGS and "[" not in p and not p.startswith("function-")))


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    try:
        return tokenizer.encode(text)
    except Exception as exc:  # e.g. lone surrogates the JSON allowed
        raise bad_request(f"text cannot be tokenized: {exc}") from None


def sampling(body: SamplingFields, prompt_len: int, settings: Settings, limit: int | None,
             stop_ids: frozenset[int]) -> SamplingParams:
    room = settings.max_context - prompt_len - 1
    if room < 1:
        raise ApiError(400, f"this model's maximum context length is {settings.max_context} "
                            f"tokens; the prompt has {prompt_len}", param="messages",
                       code="context_length_exceeded")
    if limit is not None and limit > room:
        raise ApiError(400, f"this model's maximum context length is {settings.max_context} "
                            f"tokens; the prompt has {prompt_len} and max_tokens asks for "
                            f"{limit}", param="max_tokens", code="context_length_exceeded")
    max_tokens = limit if limit is not None else min(settings.default_max_tokens, room)
    if body.min_tokens and body.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({body.min_tokens}) is more than max_tokens "
                          f"({max_tokens})", "min_tokens")
    seed = None if body.seed is None else body.seed % 2**63
    return SamplingParams(
        max_tokens=max_tokens, stop_tokens=tuple(sorted(stop_ids)),
        temperature=body.temperature if body.temperature is not None else 1.0,
        top_p=body.top_p if body.top_p is not None else 1.0,
        top_k=max(body.top_k or 0, 0), min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0, min_tokens=body.min_tokens or 0,
        seed=seed,
        logprobs=0 if body.top_n is None else max(body.top_n, 1))


def render_chat(server: Server, body: ChatRequest, encode_text: Callable[[str], list[int]]
                ) -> tuple[str, list[int], tuple[int, ...], int]:
    """Prompt text, token ids, message boundaries (the last few, where anchors may go) and
    the end of the shared prefix (system prompt and tools), 0 if none."""
    messages = [m.for_template() for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    try:
        thinking = body.enable_thinking()
    except ValueError as exc:
        raise bad_request(str(exc), "chat_template_kwargs") from None
    try:
        text = server.template.render(messages, tools=tools, add_generation_prompt=True,
                                      enable_thinking=thinking)
    except ChatTemplateError as exc:
        raise bad_request(str(exc), "messages") from None
    ids = encode_text(text)
    anchors = server.thread.engine.config.auto_anchors
    system = 1 if messages[0]["role"] == "system" else 0
    # message starts, and the end of the last message (where the generation prompt starts:
    # a retry of the same messages resumes there)
    wanted = set(range(max(1, len(messages) + 1 - anchors), len(messages) + 1))
    if system or tools:
        wanted.add(system)
    offsets: dict[int, int] = {}
    for i in sorted(wanted):
        try:
            prefix = server.template.render(messages[:i], tools=tools,
                                            enable_thinking=thinking)
        except ChatTemplateError:
            continue
        if not prefix or not text.startswith(prefix):
            continue
        head = encode_text(prefix)
        if 0 < len(head) < len(ids) and ids[:len(head)] == head:
            offsets[i] = len(head)
    shared = offsets.get(system, 0) if (system or tools) else 0
    boundaries = tuple(sorted({b for i, b in offsets.items() if i >= 1}))
    return text, ids, boundaries, shared


def opens_thinking(prompt: str) -> bool:
    """The generation prompt left a `<think>` block open: output starts as reasoning."""
    turn = prompt[prompt.rfind("<|im_start|>"):]
    return turn.rfind(THINK_OPEN) > turn.rfind(THINK_CLOSE)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="ninfer", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = server
    errors.install(app)
    from .messages_routes import messages_router  # (it builds on this module's helpers)
    app.include_router(messages_router(server))

    def check_model(name: str | None) -> None:
        if name is not None and name != server.settings.model_id \
                and name not in server.settings.model_aliases:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves "
                                f"{server.settings.model_id!r}", param="model",
                           code="model_not_found")

    def check_ready() -> None:
        if not server.ready or not server.alive:
            what = "the server failed to start" if server.failed else "the model is loading"
            if server.ready:
                what = "the engine stopped"
            raise ApiError(503, what, code="not_ready", retry_after=2)

    async def generate(request: Request, chat: bool):
        arrival = time.time()
        try:
            api_key = sessions.authenticate(request.headers, server.settings.api_keys)
            data = await read_json(request, server.settings.max_body_bytes)
            check_ready()
            body = validate(ChatRequest if chat else CompletionRequest, data)
            check_model(body.model)
            stop_ids = stop_tokens(server, body)
            session = sessions.openai_session_key(request.headers, body,
                                                  derive=server.settings.derive_session_keys)
            tenant = sessions.tenant(api_key, body.cache_salt)
            encode_text = server.history.encoder(
                lambda t: encode(server.tokenizer, t), tenant, session)
            text = None
            if chat:
                text, ids, boundaries, shared = render_chat(server, body, encode_text)
                thinking = opens_thinking(text)
                parser = OutputParser(thinking=thinking,
                                      tools=bool(body.tools) and body.tool_choice != "none")
                limit = body.output_limit
            else:
                ids, boundaries, shared, parser = completion_ids(server, body), (), 0, None
                limit = body.max_tokens
            params = sampling(body, len(ids), server.settings, limit, stop_ids)
            if chat and thinking:
                params = reasoning.bounded(params, reasoning.budget_for_effort(
                    body.reasoning_effort, server.settings.reasoning_budget), server.tokenizer)
            gen = Generation(
                server, route="openai-chat" if chat else "openai-completion",
                prompt=tuple(ids), session=session, tenant=tenant, params=params,
                prompt_text=text,
                boundaries=boundaries, shared_prefix=shared, stops=body.stop_strings(),
                parser=parser, arrival=arrival)
            gen.submit()
        except ApiError as exc:
            server.metrics.response(exc.status)
            return exc.response()
        except _ClientGone:
            server.metrics.response(499)
            return PlainTextResponse("", status_code=499)
        shape = Shape(gen, server.settings.model_id, chat, body.include_usage, body.top_n)
        return GenerationResponse(gen, shape, stream=body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.get("/v1/models")
    async def models(request: Request):
        sessions.authenticate(request.headers, server.settings.api_keys)
        return {"object": "list", "data": [{
            "id": server.settings.model_id, "object": "model", "created": 0, "owned_by": "ninfer",
            "max_model_len": server.settings.max_context}]}

    @app.get("/health")
    async def health():
        if not server.ready or not server.alive:
            status = "failed" if server.failed else "loading" if not server.ready else "stopped"
            return ApiError(503, status, code="not_ready", retry_after=2).response()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        snapshot: EngineFigures | None = None
        if server.alive:
            with contextlib.suppress(RuntimeError, TimeoutError):
                snapshot = await asyncio.wait_for(
                    asyncio.wrap_future(server.thread.call(engine_snapshot)), 30)
        return Response(server.metrics.exposition(snapshot), media_type=CONTENT_TYPE)

    @app.post("/admin/evict")
    async def evict_all(request: Request):
        """Drop every endpoint (operator action; needs a key when keys are set)."""
        sessions.authenticate(request.headers, server.settings.api_keys)
        check_ready()

        def evict(engine) -> int:
            ids = list(engine.store.endpoints)
            for endpoint_id in ids:
                engine.evict(endpoint_id, "operator")
            return len(ids)

        count = await asyncio.wrap_future(server.thread.call(evict))
        return JSONResponse({"evicted": count})

    return app


def stop_tokens(server: Server, body: SamplingFields) -> frozenset[int]:
    """The token ids that end a reply: the model's end-of-text ones (none with
    `ignore_eos`) and the request's `stop_token_ids`."""
    extra = frozenset(body.stop_token_ids or ())
    if any(t >= server.vocab_size for t in extra):
        raise bad_request(f"token ids must be in [0, {server.vocab_size})", "stop_token_ids")
    return extra | (frozenset() if body.ignore_eos else server.tokenizer.special.stop_ids)


def completion_ids(server: Server, body: CompletionRequest) -> list[int]:
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        return encode(server.tokenizer, prompt)
    if prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    if any(not 0 <= t < server.vocab_size for t in prompt):
        raise bad_request(f"token ids must be in [0, {server.vocab_size})", "prompt")
    return list(prompt)
