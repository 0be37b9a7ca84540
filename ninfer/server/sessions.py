"""Conversations and tenants: who may reuse what.

Session key (the conversation a request belongs to), first found wins:
  1. the `X-Session-Id` header;
  2. the `session_id` body field;
  3. with `--derive-session-keys` (chat only): a digest of the instructions (system and
     developer messages, in order) and the first user message.
A request without one is planned from shared prefixes only.

Tenant (who may see a cache entry): the API key in use (its digest: keys never reach the
journal) and the request's `cache_salt` together. Nothing published under one tenant is
planned for another: the store keys every endpoint by tenant."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path

from .errors import ApiError
from .schemas import ChatRequest

SESSION_HEADER = "x-session-id"


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(parts, ensure_ascii=False).encode("utf-8"))
    return h.hexdigest()


def derived_session(body: ChatRequest) -> str | None:
    instructions = [m.text() for m in body.messages if m.role in ("system", "developer")]
    first_user = next((m.text() for m in body.messages if m.role == "user"), None)
    if first_user is None:
        return None
    return "derived-" + _digest(*instructions, "\x00user", first_user)


def session_key(headers, body, *, derive: bool) -> str | None:
    explicit = headers.get(SESSION_HEADER)
    if explicit is not None:
        if not 0 < len(explicit) <= 256:
            raise ApiError(400, "X-Session-Id must be 1 to 256 characters", param="X-Session-Id")
        return "id-" + explicit
    if body.session_id is not None:
        return "id-" + body.session_id
    if derive and isinstance(body, ChatRequest):
        return derived_session(body)
    return None


def tenant(api_key: str | None, cache_salt: str | None) -> str:
    who = "key-" + hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else "open"
    return who if cache_salt is None else f"{who}/salt-{_digest(cache_salt)}"


def load_keys(values: list[str]) -> tuple[str, ...]:
    """`--api-key` values: a key, or `@PATH` for a file of keys (one a line, # comments)."""
    keys: list[str] = []
    for value in values:
        if value.startswith("@"):
            for line in Path(value[1:]).read_text("utf-8").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    keys.append(line)
        elif value:
            keys.append(value)
    return tuple(dict.fromkeys(keys))


def authenticate(headers, keys: tuple[str, ...]) -> str | None:
    """The API key in use; 401 when keys are set and none of them is given."""
    given = None
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    elif headers.get("x-api-key"):
        given = headers.get("x-api-key")
    if not keys:
        return given
    if given is None:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY'",
                       code="invalid_api_key")
    match = None
    for key in keys:  # compare with every key, in constant time each
        if hmac.compare_digest(key.encode(), given.encode()):
            match = key
    if match is None:
        raise ApiError(401, "invalid API key", code="invalid_api_key")
    return match
