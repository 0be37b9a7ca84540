"""Events: frozen dataclasses with past-tense names, one per journal row.

Every event carries the envelope (`seq`, `time`, `request`, `conversation`); the rest is
its payload, stored as JSON. `specs/events.md` lists each kind, its fields and which
consumer (fold, journal check, timelines, redrive) needs each field.
"""

from __future__ import annotations

import base64
import contextvars
import dataclasses
import functools
import json
import sys
import types
import typing
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .facts import BlockHashes, CheckpointFacts, EndpointFacts, Mode, TokenIds


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
    block_hashes: BlockHashes              # chained hashes of the prompt's full blocks
    tokens: TokenIds | None = None         # None when the journal's content is "hashes"
    params: dict[str, Any] = field(default_factory=dict)
    boundaries: tuple[int, ...] = ()       # message boundaries (anchor positions)
    shared_prefix: int = 0                 # length of the stable shared prefix, 0 if none


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class RequestStarted(Event):
    plan: str                   # Root | SharedPrefix | PrivateEndpoint | PrivateAnchor | Adopted
    endpoint: str | None        # the endpoint reused, None for Root and Adopted
    reuse_base: int
    target: int                 # tokens whose state must be computed before decoding
    adopted: str | None = None  # Adopted: the detached request whose lane it took over


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillCompleted(Event):
    cursor: int
    first_token: int | None     # None when resuming a preempted request (token already known)


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class StopReached(Event):
    reason: str                 # stop_token | max_tokens | context_limit | stop_string


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
class PrefillDetached(Event):
    """The client cut a fresh prefill: its request is over for the client, its prefill goes
    on (holding its lane) to `goal`, where its frontier is published."""

    cursor: int
    goal: int


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class PrefillAdopted(Event):
    """A detached prefill taken over in place by request `by`, at `cursor`."""

    by: str
    cursor: int


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
    tokens: tuple[int, ...] | None  # None in a journal whose content is "hashes"
    frontier: int               # state frontier after the commit
    drafted: int = 0
    accepted: int = 0
    # only when the request asked for them: per token {"token", "logprob", "top": [[id, lp]]}
    logprobs: tuple[dict, ...] | None = None
    count: int | None = None    # tokens committed, kept when the ids are left out

    @property
    def committed(self) -> int:
        """How many tokens this commit added (known with or without their ids)."""
        return committed_count(self.tokens, self.count)


def committed_count(tokens, count: int | None) -> int:
    """A commit's token count: its ids' number, or the count a "hashes" journal keeps."""
    return len(tokens) if tokens is not None else count or 0


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
    # private endpoints a session key may hold (0: a journal from before a key held several)
    endpoints_per_session: int = 0
    options: dict[str, Any] = field(default_factory=dict)


def without_token_ids(event: Event) -> Event:
    """`event` as a journal whose content is "hashes" keeps it: output token ids (and the
    log-probabilities that name tokens) left out, their number kept. Events the fold reads
    are built without ids already (the live and replayed stores stay equal)."""
    if isinstance(event, TokensCommitted) and event.tokens is not None:
        return dataclasses.replace(event, tokens=None, logprobs=None, count=len(event.tokens))
    return event


@event
@dataclass(frozen=True, kw_only=True, slots=True)
class StoreSnapshotted(Event):
    """The first event of a rotated journal file: what the events before it left behind."""

    previous: str | None        # the file this one continues
    store: dict[str, Any]       # ContinuationStore.snapshot()
    requests: dict[str, Any]    # open requests: what recovery and journal check carry over
    max_concurrency: int = 0


TERMINAL_KINDS = frozenset({"RequestFinished", "RequestCancelled", "RequestFailed"})
# after these a request has nothing more for its client: its terminal event, or the moment a
# cut prefill was detached (its work goes on, for the retry, with no one waiting for it)
CLIENT_END_KINDS = TERMINAL_KINDS | {"PrefillDetached"}


# --- JSON codec ---------------------------------------------------------------------------
# Per-class field lists are computed once; encoding is shallow (tuples go to json as they
# are) and decoding converts only the fields that need it (tuples, nested facts).

_JSON = json.JSONEncoder(separators=(",", ":"))


def _one_shot(encoder: json.JSONEncoder) -> Callable[[Any], str]:
    """`encoder.encode` of a dict, through a C encoder made once: `encode` makes one on each
    call (about 0.8 us of an event's 2). Without the circular-reference check (events hold
    none); the text is the same."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None or encoder.indent is not None:
        return encoder.encode
    c = make(None, encoder.default, json.encoder.encode_basestring_ascii
             if encoder.ensure_ascii else json.encoder.encode_basestring, None,
             encoder.key_separator, encoder.item_separator, encoder.sort_keys,
             encoder.skipkeys, encoder.allow_nan)
    return lambda obj: "".join(c(obj, 0))


_encode = _one_shot(_JSON)   # every journal row's payload (the engine writes one per commit)


# packed lists in a journal row (schema version 2): a prefix naming the item type, then the
# base64 of the items little-endian; the `facts` annotation's tag -> (prefix, array type)
PACKINGS = {"packed u32": ("u32le:", "I"),    # token ids (`facts.TokenIds`)
            "packed u64": ("u64le:", "Q")}    # block hashes (`facts.BlockHashes`)
_BY_PREFIX = {prefix: code for prefix, code in PACKINGS.values()}
# Schema version 3: a packed list may start with an earlier row's (`listrefs`):
# "u32le@<seq>+<n>:" and the base64 of the items after them: the first n items of the list
# of the same packing in the row at <seq> of the same file (a row holds at most one list
# of each packing), then these. Reading one needs the journal: the reader that decodes
# the row sets the resolver (`resolving`).
Resolve = Callable[[str, int, int], array]   # (array type, seq, n) -> the first n items
_RESOLVER: contextvars.ContextVar[Resolve | None] = contextvars.ContextVar(
    "ninfer_list_resolver", default=None)


def pack(values: tuple[int, ...], tag: str = "packed u32", *,
         after: tuple[int, int] | None = None) -> str:
    """A long list as a journal row holds it (fields annotated `facts.TokenIds` or
    `facts.BlockHashes`): base64 of the items as little-endian uint32s or uint64s, after
    their prefix. 0.3 ms for 32K token ids where their JSON took 2.4 (a version 1
    journal's rows hold JSON lists). `after` (seq, n): `values` follow the first n items
    of that row's list of this packing (schema version 3), which the text names."""
    prefix, code = PACKINGS[tag]
    packed = array(code, values)
    if sys.byteorder != "little":
        packed.byteswap()
    if after is not None:
        prefix = f"{prefix[:-1]}@{after[0]}+{after[1]}:"
    return prefix + base64.b64encode(packed.tobytes()).decode("ascii")


def token_ids(value: Any) -> tuple[int, ...] | None:
    """A packed field's items from its JSON value: packed (`pack`), a list (a version 1
    journal's rows), or null. For readers of raw rows; the decoders use it too. A list that
    names an earlier row's is read through the resolver in effect (`resolving`)."""
    if value is None:
        return None
    if type(value) is not str:
        return tuple(value)
    return tuple(packed_items(value))


def packed_items(value: str) -> array:
    """The items of a packed list's text, as an array (see `token_ids`)."""
    colon = value.find(":")
    head = value[:colon + 1]
    at = head.find("@")
    code = _BY_PREFIX.get(head if at < 0 else head[:at] + ":")
    if code is None:
        raise ValueError(f"a packed list starts with one of {sorted(_BY_PREFIX)}")
    packed = array(code)
    packed.frombytes(base64.b64decode(value[colon + 1:], validate=True))
    if sys.byteorder != "little":
        packed.byteswap()
    if at < 0:
        return packed
    resolve = _RESOLVER.get()
    seq, _, n = head[at + 1:-1].partition("+")
    if resolve is None:
        raise ValueError(f"a packed list that starts with row {seq}'s needs its journal to "
                         "be read")
    return resolve(code, int(seq), int(n)) + packed


def resolving(resolve: Resolve | None) -> contextvars.Token:
    """Make `resolve` read the packed lists that name earlier rows until `.reset(token)`."""
    return _RESOLVER.set(resolve)


def reset_resolving(token: contextvars.Token) -> None:
    _RESOLVER.reset(token)


def readable_payload(kind: str, payload: dict) -> dict:
    """A row's decoded JSON payload with its packed lists as lists, in place (for a
    person or a script reading an export); an unknown kind's as it is."""
    cls = EVENT_TYPES.get(kind)
    return payload if cls is None else _readable(cls, payload)


def _readable(cls: type, payload: dict) -> dict:
    for n in _packed(cls):
        if type(payload.get(n)) is str:
            payload[n] = list(token_ids(payload[n]))
    for n in _nested(cls):
        if type(payload.get(n)) is dict:
            _readable(_hints(cls)[n], payload[n])
    return payload


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


@functools.cache
def _packed(cls: type) -> dict[str, str]:
    """Fields of `cls` annotated `TokenIds` or `BlockHashes` (or either `| None`): name ->
    its packing's tag."""
    hints = typing.get_type_hints(cls, include_extras=True)

    def tag(tp: Any) -> str | None:
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            return next(filter(None, map(tag, typing.get_args(tp))), None)
        if typing.get_origin(tp) is typing.Annotated:
            return next((m for m in tp.__metadata__ if m in PACKINGS), None)
        return None

    return {n: t for n in _field_names(cls) if (t := tag(hints[n])) is not None}


@functools.cache
def list_paths(cls: type) -> dict[str, tuple[str, ...]]:
    """Where `cls`'s packed lists are, by packing tag: the field names from the payload down
    (through nested facts). A row holds at most one list of each packing: what makes a
    reference to "row S's u32 list" name one list (`listrefs`)."""
    out: dict[str, tuple[str, ...]] = {}
    found = [(tag, (n,)) for n, tag in _packed(cls).items()]
    hints = typing.get_type_hints(cls)
    for n in sorted(_nested(cls)):
        found += [(tag, (n, *path)) for tag, path in list_paths(hints[n]).items()]
    for tag, path in found:
        if tag in out:
            raise TypeError(f"{cls.__name__} holds two {tag} lists: {out[tag]} and {path}")
        out[tag] = path
    return out


def _converter(tp: Any):
    """A function turning a JSON value back into annotation `tp`, or None if as-is."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        inner = _converter(options[0]) if len(options) == 1 else None
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is tuple:
        return tuple
    if dataclasses.is_dataclass(tp):
        return _generated(tp, envelope=False)
    return None


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in Event.ENVELOPE)


@functools.cache
def _nested(cls: type) -> frozenset[str]:
    """Fields of `cls` holding nested facts (dataclasses)."""
    hints = typing.get_type_hints(cls)
    return frozenset(n for n in _field_names(cls) if dataclasses.is_dataclass(hints[n]))


Packer = Callable[[tuple[int, ...], str], str]   # (items, packing tag) -> the row's text


def _plain(value: Any, packer: Packer = pack) -> dict[str, Any]:
    """Nested facts as a dict, without asdict's deep copies."""
    return _as_dict(value, _nested(type(value)), packer)


def _as_dict(obj: Any, nested: frozenset[str], packer: Packer = pack) -> dict[str, Any]:
    out = {}
    packed = _packed(type(obj))
    for n in _field_names(type(obj)):
        v = getattr(obj, n)
        out[n] = _plain(v, packer) if n in nested else packer(v, packed[n]) if n in packed \
            and v is not None else v
    return out


@functools.cache
def _builder(tp: type):
    return _converter(tp)


def from_plain(tp: type, value: Any) -> Any:
    """A dataclass of type `tp` (nested facts included) rebuilt from its JSON value."""
    return _builder(tp)(value)


def to_json(ev: Event, packer: Packer = pack) -> str:
    """The payload of `ev` (everything but the envelope) as compact JSON; `packer` writes
    its packed lists (the journal's names earlier rows' lists where it can, `listrefs`)."""
    cls = type(ev)
    nested = _nested(cls)
    if nested or _packed(cls):
        return _encode(_as_dict(ev, nested, packer))
    return _encode({n: getattr(ev, n) for n in _field_names(cls)})


def to_row(ev: Event, packer: Packer = pack) -> tuple:
    """(seq, time, request, conversation, kind, data): one row of the journal's events table."""
    return (ev.seq, ev.time, ev.request, ev.conversation, ev.kind, to_json(ev, packer))


def lists_of(ev: Event) -> dict[str, tuple[int, ...]]:
    """`ev`'s packed lists that are present, by packing tag (`list_paths`)."""
    out = {}
    for tag, path in list_paths(type(ev)).items():
        v: Any = ev
        for n in path:
            v = None if v is None else getattr(v, n)
        if v is not None:
            out[tag] = v
    return out


_SCAN = json.JSONDecoder().scan_once  # the C scanner, without loads' layers around it
_ABSENT = object()


@functools.cache
def _builder_of(cls: type[Event]):
    """`build(seq, time, request, conversation, payload)` for `cls`: see `_generated`."""
    return _generated(cls, envelope=True)


def _generated(cls: type, envelope: bool):
    """A builder of the slotted dataclass `cls` from its decoded JSON dict, generated (as
    dataclasses generates __init__) to fill the slots straight from the dict: the journal
    tools decode millions of events. It pops what it reads from the dict, converts nested
    facts and tuples, refuses missing and unknown fields, and runs `__post_init__`.
    An event's builder takes the envelope first: `build(seq, time, request, conversation,
    p)`; a fact's takes `build(p)`."""
    hints = typing.get_type_hints(cls)
    packed = _packed(cls)
    name = cls.kind if envelope else cls.__name__
    env: dict[str, Any] = {"_new": object.__new__, "_cls": cls, "_ABSENT": _ABSENT,
                           "_lacks": _lacks, "_extra": _extra}
    skip = Event.ENVELOPE if envelope else ()
    head = "seq, time, request, conversation, p" if envelope else "p"
    lines = [f"def build({head}):", "    if type(p) is not dict:",
             f"        raise TypeError({name + ' is not a JSON object'!r})", "    o = _new(_cls)"]
    if not envelope:  # a nested fact's dict may be someone else's (a snapshot's): a copy
        lines.append("    p = dict(p)")
    for n in skip:
        env[f"_s_{n}"] = getattr(cls, n).__set__
        lines.append(f"    _s_{n}(o, {n})")
    for f in dataclasses.fields(cls):
        n = f.name
        if n in skip:
            continue
        env[f"_s_{n}"] = getattr(cls, n).__set__
        conv = token_ids if n in packed else _converter(hints[n])
        got = f"_c_{n}(v)" if conv is not None else "v"
        env[f"_c_{n}"] = conv
        if f.default_factory is not dataclasses.MISSING:
            env[f"_d_{n}"] = f.default_factory
            absent = f"_d_{n}()"
        elif f.default is not dataclasses.MISSING:
            env[f"_d_{n}"] = f.default
            absent = f"_d_{n}"
        else:
            absent = f"_lacks({name!r}, {n!r})"
        lines += [f"    v = p.pop({n!r}, _ABSENT)",
                  f"    _s_{n}(o, {absent} if v is _ABSENT else {got})"]
    lines += ["    if p:", f"        _extra({name!r}, p)"]
    if hasattr(cls, "__post_init__"):
        lines.append("    o.__post_init__()")
    lines.append("    return o")
    exec("\n".join(lines), env)  # noqa: S102 - code generated from the dataclass fields
    return env["build"]


def _lacks(kind: str, name: str):
    raise TypeError(f"{kind} payload lacks {name!r}")


def _extra(kind: str, payload: dict):
    raise TypeError(f"{kind} payload has unknown fields {sorted(payload)}")


def from_row(seq: int, time: float, request: str | None, conversation: str | None,
             kind: str, data: str) -> Event:
    cls = EVENT_TYPES.get(kind)
    if cls is None:
        raise UnknownEventKind(f"unknown event kind {kind!r} at seq {seq}")
    try:
        payload, end = _SCAN(data, 0)
    except StopIteration:
        raise ValueError("payload is not JSON") from None
    if end != len(data) or type(payload) is not dict:
        raise ValueError("payload is not one JSON object")
    return _builder_of(cls)(seq, time, request, conversation, payload)


def with_envelope(ev: Event, seq: int, time: float) -> Event:
    """`ev` stamped with its journal position."""
    return dataclasses.replace(ev, seq=seq, time=time)
