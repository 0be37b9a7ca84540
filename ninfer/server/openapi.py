"""The served schema: `GET /openapi.json` (and `/docs`, which reads it) describes every route
with the pydantic models it really reads and writes.

The routes read their bodies by hand (reading.py: size, UTF-8, JSON constants, then the
API's model), so FastAPI neither validates them nor sees their models. Each route is
therefore listed here with its request model, its response models (JSON and, when it can
stream, one SSE event's) and the error statuses it answers, each with its API's error body
(OpenAI's shape; Anthropic's envelope on the Messages API); the components are the models'
JSON schemas, request models as they validate, response models as they serialize, built in
one pass so that two models of one name get distinct names."""

from __future__ import annotations

from typing import Any, NamedTuple

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, RootModel
from pydantic.json_schema import models_json_schema

from .bodies import ChatCompletion, ChatCompletionChunk, Evicted, Health, ModelList, TextCompletion
from .errors import ErrorBody
from .messages_api import CountTokensRequest, MessagesRequest
from .messages_bodies import AnthropicError, MessageBody, MessagesStreamEvent, TokenCount
from .responses_bodies import ResponseObject, StreamEvent
from .responses_schema import ResponsesRequest
from .schemas import ChatRequest, CompletionRequest


class ResponsesStreamEvent(RootModel[StreamEvent]):
    """One event of a Responses API stream (its SSE `data:` line)."""


GENERATION_ERRORS = (400, 401, 404, 413, 429, 503)


class Route(NamedTuple):
    method: str
    path: str
    request: type[BaseModel] | None
    ok: type[BaseModel] | None            # the JSON body of a 200 (None: not JSON)
    event: type[BaseModel] | None = None  # one SSE event's data, when the route streams
    errors: tuple[int, ...] = GENERATION_ERRORS
    error: type[BaseModel] = ErrorBody    # the body of each error status


ROUTES = (
    Route("post", "/v1/chat/completions", ChatRequest, ChatCompletion, ChatCompletionChunk),
    Route("post", "/v1/completions", CompletionRequest, TextCompletion, TextCompletion),
    Route("post", "/v1/responses", ResponsesRequest, ResponseObject, ResponsesStreamEvent),
    Route("post", "/v1/messages", MessagesRequest, MessageBody, MessagesStreamEvent,
          error=AnthropicError),
    Route("post", "/v1/messages/count_tokens", CountTokensRequest, TokenCount,
          errors=(400, 401, 404, 413, 503), error=AnthropicError),
    Route("get", "/v1/models", None, ModelList, errors=(401,)),
    Route("get", "/health", None, Health, errors=(503,)),
    Route("get", "/metrics", None, None, errors=()),
    Route("post", "/admin/evict", None, Evicted, errors=(401, 503)),
)
_REASONS = {400: "Bad request", 401: "Unauthorized", 404: "No such model or route",
            413: "Request body too large", 429: "Too many requests waiting",
            503: "Not ready, or no room now (see Retry-After)"}


def _json(ref: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": ref}}


def _sse_event(event: dict[str, Any], error: dict[str, Any]) -> dict[str, Any]:
    """One server-sent event: its data is the JSON of `event` (or, ending a stream that
    failed, an error body), or chat and text completions' closing `[DONE]`."""
    body = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [event, error]}}
    return {"type": "object", "required": ["data"], "properties": {
        "event": {"type": "string"}, "data": {"anyOf": [{"const": "[DONE]"}, body]}}}


def schema(app: FastAPI) -> dict[str, Any]:
    """The OpenAPI document of `app`: FastAPI's paths, each operation completed from ROUTES."""
    document = get_openapi(title=app.title, version=app.version, routes=app.routes,
                           description=app.description)
    wanted = [(r.request, "validation") for r in ROUTES if r.request]
    wanted += [(m, "serialization") for r in ROUTES for m in (r.ok, r.event) if m]
    wanted += [(m, "serialization") for m in dict.fromkeys(r.error for r in ROUTES)]
    refs, definitions = models_json_schema(wanted, ref_template="#/components/schemas/{model}")
    document.setdefault("components", {})["schemas"] = definitions.get("$defs", {})
    listed = {(r.path, r.method) for r in ROUTES}
    for path, operations in document["paths"].items():
        missing = [method for method in operations if (path, method) not in listed]
        if missing:  # a route added without its models
            raise ValueError(f"{missing[0].upper()} {path} is not described in ROUTES")
    for route in ROUTES:
        operation = document["paths"][route.path][route.method]
        error = refs[(route.error, "serialization")]
        if route.request is not None:
            operation["requestBody"] = {"required": True,
                                        "content": _json(refs[(route.request, "validation")])}
        content: dict[str, Any] = {}
        if route.ok is not None:
            content.update(_json(refs[(route.ok, "serialization")]))
        if route.event is not None:
            content["text/event-stream"] = {"schema": _sse_event(
                refs[(route.event, "serialization")], error)}
        if route.ok is None:
            content["text/plain"] = {"schema": {"type": "string"}}
        operation["responses"] = {"200": {"description": "OK", "content": content}} | {
            str(status): {"description": _REASONS[status], "content": _json(error)}
            for status in route.errors}
        if route.event is not None:
            operation["responses"]["200"]["description"] = (
                "OK: one JSON body, or with `stream: true` server-sent events, each a "
                f"{route.event.__name__} ({refs[(route.event, 'serialization')]['$ref']})")
    return document


def install(app: FastAPI) -> None:
    """Serve the schema built here (once, on first request) at /openapi.json."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = schema(app)
        return app.openapi_schema

    app.openapi = openapi
