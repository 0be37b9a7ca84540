"""Reading a request body: content type, size, UTF-8, JSON, then the API's pydantic model.
Every failure is an ApiError (400 or 413) naming what is wrong, in the calling API's terms
(the first error of the field that matters, as `param`)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from .errors import ApiError, bad_request


class ClientGone(Exception):
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
        raise ClientGone() from exc
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


def validate(model: type, data: dict, tags: frozenset[str] = frozenset()):
    """`data` as `model`, or a 400 naming the field at fault; `tags` are the names of
    discriminated unions' branches, left out of that name."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # in a union, the branch whose type matched says more than the ones that did not
        ranked = sorted(exc.errors(include_url=False),
                        key=lambda e: (e["type"].endswith("_type"),
                                       -len(_field_path(e["loc"], tags))))
        first = ranked[0]
        param = ".".join(str(p) for p in _field_path(first["loc"], tags)) or None
        message = first["msg"].removeprefix("Value error, ")
        raise bad_request(f"{param}: {message}" if param else message, param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _field_path(loc: tuple, tags: frozenset[str] = frozenset()) -> tuple:
    """A pydantic location without its union-branch tags (`str`, `list[str]`, ...)."""
    return tuple(p for p in loc if isinstance(p, int) or (
        p not in _TYPE_TAGS and p not in tags and "[" not in p
        and not p.startswith("function-")))


