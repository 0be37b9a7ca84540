"""A conversation's private endpoints: several per session key, one per branch.

An agent's main loop, its sub-agents and its side calls often share one session key, so a
key holds several private endpoints, each the latest point of one branch. The rule, applied
by the engine after every publication under the key (`Engine._evict_within_session`) and
recorded as `EndpointEvicted` events, so that the fold only ever applies what the journal
says:

1. `superseded`: a private endpoint that a later-published private endpoint of the same key
   extends (its tokens start with the older one's) is evicted: that branch moved forward.
2. `session_bound`: past `endpoints_per_session` private endpoints, the least recently used
   (last planned, else published) is evicted, until the key is within its bound.

The engine decides `extends` on the token ids it holds; `journal check` verifies each
eviction from the recorded facts with `may_extend`, which the exact relation implies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from .facts import EndpointFacts
from .hashing import HASH_BLOCK

SUPERSEDED = "superseded"
SESSION_BOUND = "session_bound"


class Eviction(NamedTuple):
    endpoint: str
    reason: str           # SUPERSEDED | SESSION_BOUND


class Point(Protocol):
    """A stored private endpoint as this rule sees it (`store.StoredEndpoint`)."""

    facts: EndpointFacts
    published_seq: int
    last_used_seq: int


Extends = Callable[[EndpointFacts, EndpointFacts], bool]
"""`extends(newer, older)`: newer's tokens start with older's (equal tokens included)."""


def evictions(points: Sequence[Point], bound: int, extends: Extends) -> list[Eviction]:
    """The evictions that bring one key's private endpoints back to distinct branches
    within `bound`: superseded ones first (oldest first), then the least recently used."""
    ordered = sorted(points, key=lambda p: p.published_seq)
    out: list[Eviction] = []
    kept: list[Point] = []
    for i, older in enumerate(ordered):
        if any(extends(newer.facts, older.facts) for newer in ordered[i + 1:]):
            out.append(Eviction(older.facts.id, SUPERSEDED))
        else:
            kept.append(older)
    excess = len(kept) - bound
    if excess > 0:
        by_use = sorted(kept, key=least_recently_used)
        out.extend(Eviction(p.facts.id, SESSION_BOUND) for p in by_use[:excess])
    return out


def least_recently_used(point: Point) -> tuple[int, int]:
    """Sort key: last planned, then published; the smallest goes first."""
    return (point.last_used_seq, point.published_seq)


def may_extend(newer: EndpointFacts, older: EndpointFacts) -> bool:
    """What the recorded facts allow: newer's tokens may start with older's. Exact when
    older's position is a whole number of hash blocks or both carry token ids; otherwise
    the last partial block of older is not compared (its hash covers only older's tokens)."""
    a, b = newer.checkpoint, older.checkpoint
    if b.position > a.position:
        return False
    full = b.position // HASH_BLOCK
    if a.block_hashes[:full] != b.block_hashes:
        return False
    if a.tokens is not None and b.tokens is not None:
        return a.tokens[:b.position] == b.tokens
    return True
