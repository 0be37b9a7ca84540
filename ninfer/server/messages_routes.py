"""The Messages API's routes (`POST /v1/messages`, `POST /v1/messages/count_tokens`, both
also with `?beta=true`): read (reading.py), authenticate (`x-api-key` or `Authorization:
Bearer`, the server's `--api-key` tenants), validate, convert to the request type underneath
(messages_api.py), then start it on the path underneath (submission.py) as chat completions
and responses do; answered in Anthropic's grammar (messages_stream.py), every error in its
envelope.

Two steps are the Messages API's own: a prompt that leaves no room is the 400 `prompt is too
long: N tokens > M maximum` (the wording clients look for to compact their history), and a
`max_tokens` larger than what the context leaves is lowered to fit (Claude Code asks for up
to 64K), reaching it reported as `model_context_window_exceeded`.

`anthropic-version` and `anthropic-beta` headers are accepted whatever they say. A model
name is served when it is the server's model id, one of its `--model-alias` names, or (by
default) any `claude-*` name, so Claude Code's model choices all reach the loaded model."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from . import sessions
from .errors import ApiError, bad_request
from .messages_api import CountTokensRequest, MessagesRequest, MessagesTurn, to_unified
from .messages_bodies import TokenCount, anthropic_error
from .messages_stream import MessagesShape
from .reading import ClientGone, read_json, validate
from .streaming import GenerationResponse
from .submission import ContextExceeded, check_ready, encode, render_chat, start

if TYPE_CHECKING:
    from .app import Server

log = logging.getLogger("ninfer.server")


def serves(server: Server, name: str) -> bool:
    """Whether `name` is a model this server answers for on the Messages API."""
    settings = server.settings
    return (name == settings.model_id or name in settings.model_aliases
            or (settings.claude_names and name.startswith("claude-")))


def error_response(error: ApiError) -> JSONResponse:
    """An error before any answer, in Anthropic's envelope."""
    headers = {}
    if error.retry_after is not None:
        headers["Retry-After"] = str(max(1, round(error.retry_after)))
    return JSONResponse(anthropic_error(error).model_dump(), status_code=error.status,
                        headers=headers)


def _in_its_words(error: ApiError) -> ApiError:
    """An error of the path underneath as the Messages API words it."""
    if isinstance(error, ContextExceeded) and error.asked is None:
        return bad_request(f"prompt is too long: {error.prompt_len} tokens > "
                           f"{error.longest_prompt} maximum", "messages")
    return error


async def _read(request: Request, kind: type[MessagesRequest] | type[CountTokensRequest]):
    """The API key and the validated body, its model checked; the request converted."""
    server: Server = request.app.state.server
    api_key = sessions.authenticate(request.headers, server.settings.api_keys)
    data = await read_json(request, server.settings.max_body_bytes)
    check_ready(server)
    body = validate(kind, data)
    if not serves(server, body.model):
        raise ApiError(404, f"model: {body.model!r} is not served here; this server serves "
                            f"{server.settings.model_id!r}", param="model")
    turn: MessagesTurn = to_unified(body, default_budget=server.settings.reasoning_budget)
    if turn.dropped_tools:
        log.warning("messages: built-in tools this server does not run were dropped: %s",
                    ", ".join(turn.dropped_tools))
    return api_key, body, turn


router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request):
    server: Server = request.app.state.server
    arrival = time.time()
    try:
        api_key, body, turn = await _read(request, MessagesRequest)
        gen = await start(server, turn.request, headers=request.headers, api_key=api_key,
                          arrival=arrival)
    except Exception as exc:  # every failure gets its answer, counted
        return _refused(server, exc, _in_its_words)
    shape = MessagesShape(gen, body.model, clamped=gen.params.max_tokens < body.max_tokens)
    return GenerationResponse(gen, shape, stream=body.stream)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    """The prompt's tokens as `POST /v1/messages` would render them."""
    server: Server = request.app.state.server
    try:
        _, _, turn = await _read(request, CountTokensRequest)
        ids = render_chat(server, turn.request, lambda t: encode(server.tokenizer, t),
                          plain=True).ids
    except Exception as exc:  # every failure gets its answer, counted
        return _refused(server, exc)
    server.metrics.response(200)
    return JSONResponse(TokenCount(input_tokens=len(ids)).model_dump())


def _refused(server: Server, exc: Exception, words=lambda e: e):
    """The counted answer to a request that failed before it started: its ApiError (in
    `words`), nothing for a client that went away, else a logged 500."""
    if isinstance(exc, ApiError):
        server.metrics.response(exc.status)
        return error_response(words(exc))
    if isinstance(exc, ClientGone):
        server.metrics.response(499)
        return PlainTextResponse("", status_code=499)
    log.error("messages: internal error", exc_info=exc)
    server.metrics.response(500)
    return error_response(ApiError(500, "internal error"))


async def _wrong_method(request: Request):
    return error_response(ApiError(405, f"method {request.method} not allowed; POST"))


# other methods get a 405 in Anthropic's envelope (the app's own handler would answer in
# OpenAI's); they are not operations, so the served schema leaves them out
for _path in ("/v1/messages", "/v1/messages/count_tokens"):
    router.add_api_route(_path, _wrong_method, methods=["GET", "PUT", "PATCH", "DELETE"],
                         include_in_schema=False)
