"""The planner: how a request starts. Total by construction: Root always exists."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import salvage
from .facts import EndpointFacts, Mode
from .hashing import HASH_BLOCK, prefix_hash
from .store import ContinuationStore

PLAN_KINDS = {"private": "PrivateEndpoint", "anchor": "PrivateAnchor", "shared": "SharedPrefix"}


@dataclass(frozen=True, slots=True)
class Fallback:
    candidate: str
    position: int
    reason: str


@dataclass(frozen=True, slots=True)
class Plan:
    kind: str       # Root | PrivateEndpoint | PrivateAnchor | SharedPrefix | Adopted
    endpoint: EndpointFacts | None
    reuse_base: int
    fallbacks: tuple[Fallback, ...] = ()
    adopted: str | None = None         # Adopted: the detached request whose lane it takes


def matches(tokens: Sequence[int], hashes: tuple[int, ...], endpoint: EndpointFacts) -> bool:
    """`tokens` start with the endpoint's tokens (on hashes; on ids too when recorded)."""
    cp = endpoint.checkpoint
    p = cp.position
    if p > len(tokens):
        return False
    full = p // HASH_BLOCK
    if hashes[:full] != cp.block_hashes or prefix_hash(tokens, p, hashes) != cp.prefix_hash:
        return False
    return cp.tokens is None or tuple(tokens[:p]) == cp.tokens


def plan(
    tokens: Sequence[int],
    hashes: tuple[int, ...],
    tenant: str,
    session: str | None,
    store: ContinuationStore,
    mode: Mode,
    usable: Callable[[EndpointFacts], str | None] | None = None,
) -> Plan:
    """The longest candidate whose tokens prefix `tokens` and that passes the predicate
    (and `usable`, the engine's own check: tensors present, memory to restore), else Root.

    `reuse_base < len(tokens)` always: at least one token is computed. Never raises: an
    unusable candidate becomes a `Fallback` and the next one is tried.
    """
    fallbacks: list[Fallback] = []
    for endpoint in store.candidates(tenant, session):
        if not matches(tokens, hashes, endpoint):
            continue
        p = endpoint.position
        reason = None
        if p >= len(tokens):
            reason = "covers the whole prompt; at least one token must be computed"
        else:
            decision = salvage.materializable(endpoint.checkpoint, mode)
            if not decision.ok:
                reason = decision.reason
            elif usable is not None:
                try:
                    reason = usable(endpoint)
                except Exception as exc:  # the planner is total: a failing check is a fallback
                    reason = f"usability check failed: {exc!r}"
        if reason is None:
            return Plan(PLAN_KINDS[endpoint.kind], endpoint, p, tuple(fallbacks))
        fallbacks.append(Fallback(endpoint.id, p, reason))
    return Plan("Root", None, 0, tuple(fallbacks))
