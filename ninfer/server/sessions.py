"""Conversations and tenants: who may reuse what.

Session key (the conversation a request belongs to): each API adapter lists where its
requests may carry one, in order of precedence, as `KeySource`s; the first with a value
wins (`submission.request_session_key` puts them together for a `UnifiedRequest`):
  1. the `X-Session-Id` header, for every API;
  2. the API's own fields: chat and text completions' `session_id`, then OpenAI's
     `prompt_cache_key`; the Responses API's `prompt_cache_key`; the Messages API's
     `session_id`, then Anthropic's `metadata.user_id` (where Claude Code puts its session);
  3. unless `--no-derive-session-keys` (chat, responses and messages, not text
     completions): a digest of the instructions (system and developer messages, in order,
     before any merging) and the first user message, so the same conversation gets the same
     key whichever API sends it.
A request without a key is planned from shared prefixes only.

Tenant (who may see a cache entry): the API key in use (its digest: keys never reach the
journal) and the request's `cache_salt` together. Nothing published under one tenant is
planned for another: the store keys every endpoint by tenant."""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from .errors import ApiError

SESSION_HEADER = "x-session-id"


class KeySource(NamedTuple):
    """One place a session key may come from. The key is `namespace-value`: namespaces
    are words without '-', so keys from different namespaces never collide; sources that
    name the same thing (the header and `session_id`) share one. The value must be valid
    Unicode, since the journal stores it: a length-constrained pydantic string field (as
    the schemas' key fields are) refuses a lone surrogate."""

    namespace: str      # id | cache | derived (an adapter may add its own)
    value: str | None   # None (or empty) when the request does not carry it


def session_key(sources: Iterable[KeySource]) -> str | None:
    """The key of the first source with a value, or None when none has one."""
    for source in sources:
        if source.value:
            return f"{source.namespace}-{source.value}"
    return None


def header_source(headers) -> KeySource:
    """`X-Session-Id`, the first source of every API (400 when it is empty or too long)."""
    explicit = headers.get(SESSION_HEADER)
    if explicit is not None and not 0 < len(explicit) <= 256:
        raise ApiError(400, "X-Session-Id must be 1 to 256 characters", param="X-Session-Id")
    return KeySource("id", explicit)


def _digest(*parts: str) -> str:
    h = hashlib.blake2b(digest_size=8)
    # surrogatepass: a lone surrogate gets its 400 from the tokenizer, not from here
    h.update(json.dumps(parts, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def derived_key(instructions: Sequence[str], first_user: str | None) -> str | None:
    """The last source: a digest of the instructions, in order, and the first user message
    (None without one). The same conversation gets the same key whichever API sends it."""
    if first_user is None:
        return None
    return _digest(*instructions, "\x00user", first_user)


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
