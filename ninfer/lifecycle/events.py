"""Events: frozen dataclasses with past-tense names, one per journal row.

Every event carries the envelope (`seq`, `time`, `request`, `conversation`); the rest is
its payload, stored as JSON. `specs/events.md` lists each kind, its fields and which
consumer (fold, journal check, timelines, redrive) needs each field.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .facts import CheckpointFacts, EndpointFacts, Mode


class UnknownEventKind(ValueError):
    """A journal row names an event kind this code does not know."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Event:
    seq: int = 0
    time: float = 0.0
    request: str | None = None
    conversation: str | None = None

    kind: ClassVar[str] = "Event"
    ENVELOPE: ClassVar[tuple[str, ...]] = ("seq", "time", "request", "conversation")


EVENT_TYPES: dict[str, type[Event]] = {}


def event(cls: type) -> type:
    """Register an event class under its name (its `kind`)."""
    cls.kind = cls.__name__
    EVENT_TYPES[cls.kind] = cls
    return cls


# --- request lifecycle (transitions) ---------------------------------------------------


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestQueued(Event):
    tenant: str
    prompt_len: int
    block_hashes: tuple[int, ...]          # chained hashes of the prompt's full blocks
    tokens: tuple[int, ...] | None = None  # None when the journal's content is "hashes"
    params: dict[str, Any] = field(default_factory=dict)
    boundaries: tuple[int, ...] = ()       # message boundaries (anchor positions)
    shared_prefix: int = 0                 # length of the stable shared prefix, 0 if none


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestStarted(Event):
    plan: str                   # Root | SharedPrefix | PrivateEndpoint | PrivateAnchor
    endpoint: str | None        # the endpoint reused, None for Root
    reuse_base: int
    target: int                 # tokens whose state must be computed before decoding


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillCompleted(Event):
    cursor: int
    first_token: int | None     # None when resuming a preempted request (token already known)


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class StopReached(Event):
    reason: str                 # stop_token | max_tokens | context_limit


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class EndpointPublished(Event):
    endpoint: EndpointFacts


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class PublicationRefused(Event):
    checkpoint: str | None
    position: int
    reason: str


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestFinished(Event):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestCancelled(Event):
    at_state: str
    completion_tokens: int = 0


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestPreempted(Event):
    at_state: str
    frontier: int


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestFailed(Event):
    failure: str                # invalid | capacity | internal | interrupted
    message: str


# --- progress (no transition) ------------------------------------------------------------


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class PlanFallback(Event):
    candidate: str
    position: int
    reason: str


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillAdvanced(Event):
    cursor: int


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointCaptured(Event):
    checkpoint: CheckpointFacts


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class TokensCommitted(Event):
    tokens: tuple[int, ...]
    frontier: int               # state frontier after the commit
    drafted: int = 0
    accepted: int = 0


# --- store and server ---------------------------------------------------------------------


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class EndpointEvicted(Event):
    endpoint: str
    reason: str


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class EndpointLost(Event):
    endpoint: str
    reason: str


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class ServerStarted(Event):
    mode: Mode
    max_concurrency: int
    max_endpoints: int
    options: dict[str, Any] = field(default_factory=dict)


TERMINAL_KINDS = frozenset({"RequestFinished", "RequestCancelled", "RequestFailed"})


# --- JSON codec ---------------------------------------------------------------------------


def _decoder(tp: Any):
    """Build a function turning a JSON value back into a value of annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _decoder(options[0]) if len(options) == 1 else (lambda v: v)
        return lambda v: None if v is None else inner(v)
    if origin is tuple:
        return tuple
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = {f.name: _decoder(hints[f.name]) for f in dataclasses.fields(tp)}
        return lambda v: tp(**{k: fields[k](x) for k, x in v.items()})
    return lambda v: v


_DECODERS: dict[str, dict[str, Any]] = {}


def _decoders(cls: type[Event]) -> dict[str, Any]:
    found = _DECODERS.get(cls.kind)
    if found is None:
        hints = typing.get_type_hints(cls)
        found = {
            f.name: _decoder(hints[f.name])
            for f in dataclasses.fields(cls)
            if f.name not in Event.ENVELOPE
        }
        _DECODERS[cls.kind] = found
    return found


def _payload(ev: Event) -> dict[str, Any]:
    out = {}
    for name in _decoders(type(ev)):
        value = getattr(ev, name)
        out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return out


def to_json(ev: Event) -> str:
    """The payload of `ev` (everything but the envelope) as compact JSON."""
    return json.dumps(_payload(ev), separators=(",", ":"))


def to_row(ev: Event) -> tuple:
    """(seq, time, request, conversation, kind, data): one row of the journal's events table."""
    return (ev.seq, ev.time, ev.request, ev.conversation, ev.kind, to_json(ev))


def from_row(seq: int, time: float, request: str | None, conversation: str | None,
             kind: str, data: str) -> Event:
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise UnknownEventKind(f"unknown event kind {kind!r} at seq {seq}")
    decoders = _decoders(cls)
    payload = {k: decoders[k](v) for k, v in json.loads(data).items()}
    return cls(seq=seq, time=time, request=request, conversation=conversation, **payload)


def with_envelope(ev: Event, seq: int, time: float) -> Event:
    """`ev` stamped with its journal position."""
    return dataclasses.replace(ev, seq=seq, time=time)
