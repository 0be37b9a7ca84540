"""The Messages API's routes (`POST /v1/messages`, `POST /v1/messages/count_tokens`, both
also with `?beta=true`): read, authenticate (`x-api-key` or `Authorization: Bearer`, the
server's `--api-key` tenants), validate, convert to a chat request (messages_api.py), then
the same rendering, session key, tenant, sampling and engine submission as chat completions;
answered in Anthropic's grammar (messages_stream.py), every error in its envelope.

`anthropic-version` and `anthropic-beta` headers are accepted whatever they say. A model
name is served when it is the server's model id, one of its `--model-alias` names, or (by
default) any `claude-*` name, so Claude Code's model choices all reach the loaded model."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import sessions
from .app import (
    Server,
    _ClientGone,
    encode,
    opens_thinking,
    read_json,
    render_chat,
    sampling,
    stop_tokens,
    validate,
)
from .errors import ApiError, bad_request
from .generation import Generation
from .messages_api import (
    ChatTurn,
    CountTokensRequest,
    MessagesRequest,
    error_response,
    messages_session_key,
    to_chat,
)
from .messages_stream import MessagesResponse, MessagesShape, TokenCount
from .parsing import OutputParser
from .reasoning import bounded

log = logging.getLogger("ninfer.server")
ROUTE = "anthropic-messages"


def serves(server: Server, name: str) -> bool:
    """Whether `name` is a model this server answers for on the Messages API."""
    settings = server.settings
    return (name == settings.model_id or name in settings.model_aliases
            or (settings.claude_names and name.startswith("claude-")))


def prompt_too_long(prompt_len: int, max_context: int) -> ApiError:
    """The wording clients look for to compact their history."""
    return bad_request(f"prompt is too long: {prompt_len} tokens > {max_context - 2} maximum",
                       "messages")


def messages_router(server: Server) -> APIRouter:
    router = APIRouter()

    def check_ready() -> None:
        if not server.ready or not server.alive:
            what = "the server failed to start" if server.failed else "the model is loading"
            raise ApiError(503, "the engine stopped" if server.ready else what,
                           code="not_ready", retry_after=2)

    def check_model(name: str) -> None:
        if not serves(server, name):
            raise ApiError(404, f"model: {name!r} is not served here; this server serves "
                                f"{server.settings.model_id!r}", param="model")

    async def read(request: Request, kind: type) -> tuple[str | None, MessagesRequest]:
        api_key = sessions.authenticate(request.headers, server.settings.api_keys)
        data = await read_json(request, server.settings.max_body_bytes)
        check_ready()
        body = validate(kind, data)
        check_model(body.model)
        return api_key, body

    def turn_of(body) -> ChatTurn:
        turn = to_chat(body, default_budget=server.settings.reasoning_budget)
        if turn.dropped_tools:
            log.warning("messages: built-in tools this server does not run were dropped: %s",
                        ", ".join(turn.dropped_tools))
        return turn

    async def answer(request: Request):
        arrival = time.time()
        try:
            api_key, body = await read(request, MessagesRequest)
            turn = turn_of(body)
            chat = turn.chat
            settings = server.settings
            session = messages_session_key(request.headers, body, chat,
                                           derive=settings.derive_session_keys)
            tenant = sessions.tenant(api_key, chat.cache_salt)
            encode_text = server.history.encoder(
                lambda t: encode(server.tokenizer, t), tenant, session)
            text, ids, boundaries, shared = render_chat(server, chat, encode_text)
            room = settings.max_context - len(ids) - 1
            if room < 1:
                raise prompt_too_long(len(ids), settings.max_context)
            limit = min(chat.output_limit, room)  # Claude Code asks for up to 64K
            params = sampling(chat, len(ids), settings, limit, stop_tokens(server, chat))
            thinking = opens_thinking(text)
            if thinking:
                params = bounded(params, turn.reasoning_budget, server.tokenizer)
            parser = OutputParser(thinking=thinking,
                                  tools=bool(chat.tools) and chat.tool_choice != "none")
            gen = Generation(server, route=ROUTE, prompt=tuple(ids), session=session,
                             tenant=tenant, params=params, prompt_text=text,
                             boundaries=boundaries, shared_prefix=shared,
                             stops=chat.stop_strings(), parser=parser, arrival=arrival)
            gen.submit()
        except ApiError as exc:
            server.metrics.response(exc.status)
            return error_response(exc)
        except _ClientGone:
            server.metrics.response(499)
            return PlainTextResponse("", status_code=499)
        except Exception:
            log.exception("messages: internal error")
            server.metrics.response(500)
            return error_response(ApiError(500, "internal error"))
        shape = MessagesShape(gen, body.model, clamped=limit < chat.output_limit)
        return MessagesResponse(gen, shape, stream=body.stream)

    async def count(request: Request):
        try:
            _, body = await read(request, CountTokensRequest)
            chat = turn_of(body).chat
            _, ids, _, _ = render_chat(server, chat, lambda t: encode(server.tokenizer, t))
        except ApiError as exc:
            server.metrics.response(exc.status)
            return error_response(exc)
        except _ClientGone:
            server.metrics.response(499)
            return PlainTextResponse("", status_code=499)
        except Exception:
            log.exception("messages: internal error")
            server.metrics.response(500)
            return error_response(ApiError(500, "internal error"))
        server.metrics.response(200)
        return JSONResponse(TokenCount(input_tokens=len(ids)).model_dump())

    async def wrong_method(request: Request):
        return error_response(ApiError(405, f"method {request.method} not allowed; POST"))

    # `?beta=true` (the anthropic package's beta client, Claude Code) reaches the same routes
    router.add_api_route("/v1/messages", answer, methods=["POST"])
    router.add_api_route("/v1/messages/count_tokens", count, methods=["POST"])
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        router.add_api_route(path, wrong_method, methods=["GET", "PUT", "PATCH", "DELETE"])
    return router
