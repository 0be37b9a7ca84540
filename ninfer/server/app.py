"""The FastAPI app: the server's shared state and the routes. Each API's route reads its body
(reading.py), converts it to the one request type (unified.py) and starts it on the path
underneath (submission.py); its responses are shaped in the API's own grammar. The Responses
API's and the Messages API's routes are routers of their own (responses_api.py,
messages_routes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import itertools
import logging
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..engine.thread import EngineThread
from ..model.template import ChatTemplate
from ..model.tokenizer import Tokenizer
from . import errors, openapi, sessions
from .bodies import Evicted, Health, ModelCard, ModelList
from .errors import ApiError, bad_request
from .generation import Settings
from .history import History
from .messages_routes import router as messages_router
from .metrics import CONTENT_TYPE, EngineFigures, Metrics, engine_snapshot
from .reading import ClientGone, read_json, validate
from .responses_api import router as responses_router
from .schemas import ChatRequest, CompletionRequest
from .streaming import GenerationResponse, Shape
from .submission import check_ready, start
from .unified import from_chat, from_completion

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


def _version() -> str:
    try:
        return importlib.metadata.version("ninfer")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout not installed
        return "0"


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="ninfer", version=_version(), docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json",
                  description="OpenAI's chat completions, completions and Responses API and "
                              "Anthropic's Messages API on one engine; errors in the calling "
                              "API's shape.")
    app.state.server = server
    errors.install(app)
    app.include_router(responses_router)
    app.include_router(messages_router)
    openapi.install(app)

    async def generate(request: Request, chat: bool):
        arrival = time.time()
        try:
            api_key = sessions.authenticate(request.headers, server.settings.api_keys)
            data = await read_json(request, server.settings.max_body_bytes)
            check_ready(server)
            body = validate(ChatRequest if chat else CompletionRequest, data)
            try:
                unified = (from_chat(body, default_budget=server.settings.reasoning_budget)
                           if chat else from_completion(body))
            except ValueError as exc:
                raise bad_request(str(exc), "chat_template_kwargs") from None
            gen = await start(server, unified, headers=request.headers, api_key=api_key,
                              arrival=arrival)
        except ApiError as exc:
            server.metrics.response(exc.status)
            return exc.response()
        except ClientGone:
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
        card = ModelCard(id=server.settings.model_id, max_model_len=server.settings.max_context)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health():
        if not server.ready or not server.alive:
            status = "failed" if server.failed else "loading" if not server.ready else "stopped"
            return ApiError(503, status, code="not_ready", retry_after=2).response()
        return JSONResponse(Health().model_dump())

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
        check_ready(server)

        def evict(engine) -> int:
            ids = list(engine.store.endpoints)
            for endpoint_id in ids:
                engine.evict(endpoint_id, "operator")
            return len(ids)

        count = await asyncio.wrap_future(server.thread.call(evict))
        return JSONResponse(Evicted(evicted=count).model_dump())

    return app

