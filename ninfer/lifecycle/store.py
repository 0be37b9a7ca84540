"""The continuation store: nothing but the fold of the journal's events.

`ContinuationStore.apply(event)` is the only way it changes, live or in replay, so a
store rebuilt from a journal equals the live one by construction. The fold re-checks the
recorded facts of every `EndpointPublished` with the one predicate and raises
`InvariantViolation` if they fail: an event is never silently dropped.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass

from . import events as ev
from . import salvage
from .facts import EndpointFacts, Mode


class InvariantViolation(Exception):
    """An invariant of specs/invariants.md does not hold at `seq`."""

    def __init__(self, invariant: int, seq: int, message: str, request: str | None = None):
        self.invariant, self.seq, self.request, self.detail = invariant, seq, request, message
        where = f"seq {seq}" + (f", request {request}" if request else "")
        super().__init__(f"invariant {invariant} violated at {where}: {message}")


@dataclass(slots=True)
class StoredEndpoint:
    facts: EndpointFacts
    published_seq: int
    last_used_seq: int


class ContinuationStore:
    """Private endpoints per (tenant, session): the latest point of each of the
    conversation's branches (lifecycle/conversation.py) plus anchors at message boundaries;
    shared stable prefixes per tenant. Keyed by tenant throughout, so one tenant's entries
    are never visible to another."""

    def __init__(self) -> None:
        self.mode: Mode | None = None
        self.max_endpoints = 0
        # private endpoints a session key may hold; 0 in a journal written before a key
        # held several: there a new private endpoint replaces the key's one (`_index`)
        self.endpoints_per_session = 0
        self.applied_seq = 0
        self.endpoints: dict[str, StoredEndpoint] = {}
        # each key's private endpoint ids, in publication order (a dict: O(1) removal)
        self._private: dict[tuple[str, str], dict[str, None]] = {}
        self._anchors: dict[tuple[str, str], dict[int, str]] = {}
        self._shared: dict[str, dict[int, str]] = {}

    # --- the fold -----------------------------------------------------------------------

    def apply(self, event: ev.Event) -> None:
        if event.seq <= self.applied_seq:
            raise InvariantViolation(
                4, event.seq, f"seq not increasing (after {self.applied_seq})", event.request
            )
        handler = _HANDLERS.get(type(event))
        if handler is not None:
            handler(self, event)
        self.applied_seq = event.seq

    def advance(self, seq: int, request: str | None = None) -> None:
        """An event of a kind the fold ignores (not in FOLD_KINDS), known by its seq alone:
        what `apply` does with it, without decoding it."""
        if seq <= self.applied_seq:
            raise InvariantViolation(4, seq, f"seq not increasing (after {self.applied_seq})",
                                     request)
        self.applied_seq = seq

    def _server_started(self, e: ev.ServerStarted) -> None:
        for stored in self.endpoints.values():  # recovery drops what fails the new mode first
            decision = salvage.materializable(stored.facts.checkpoint, e.mode)
            if not decision.ok:
                raise InvariantViolation(
                    1, e.seq, f"endpoint {stored.facts.id} kept across a restart but "
                    f"{decision.reason}")
        self.mode = e.mode
        self.max_endpoints = e.max_endpoints
        self.endpoints_per_session = e.endpoints_per_session

    def _published(self, e: ev.EndpointPublished) -> None:
        facts = e.endpoint
        if self.mode is None:
            raise InvariantViolation(1, e.seq, "endpoint published before ServerStarted", e.request)
        decision = salvage.materializable(facts.checkpoint, self.mode)
        if not decision.ok:
            raise InvariantViolation(
                1, e.seq, f"endpoint {facts.id} published but {decision.reason}", e.request
            )
        if facts.id in self.endpoints:
            raise InvariantViolation(1, e.seq, f"endpoint {facts.id} published twice", e.request)
        self._index(facts, e.seq, e.seq)

    def _index(self, facts: EndpointFacts, published_seq: int, last_used_seq: int) -> None:
        """Hold `facts`, replacing the endpoint in the same place (anchor position, shared
        position). Private endpoints are added beside the key's others: the engine evicts
        superseded ones and those past the key's bound with events of their own."""
        key = (facts.tenant, facts.session or "")
        if facts.kind == "private":
            ids = self._private.get(key)
            if ids is None:
                self._private[key] = {facts.id: None}
            else:
                if not self.endpoints_per_session:  # an older journal: one latest point a key
                    for old in ids:
                        del self.endpoints[old]
                    ids.clear()
                ids[facts.id] = None
        else:
            index = (
                self._anchors.setdefault(key, {})
                if facts.kind == "anchor"
                else self._shared.setdefault(facts.tenant, {})
            )
            self._drop(index.get(facts.position))
            index[facts.position] = facts.id
        self.endpoints[facts.id] = StoredEndpoint(facts, published_seq, last_used_seq)

    def _snapshotted(self, e: ev.StoreSnapshotted) -> None:
        if self.applied_seq == 0:  # a rotated journal opens here: start from its snapshot
            self._load(e)
        elif _plain(self.snapshot()) != _plain({"endpoints_per_session": 0, **e.store}):
            raise InvariantViolation(5, e.seq, "the snapshot differs from the store folded from "
                                     "the events before it")

    def _load(self, e: ev.StoreSnapshotted) -> None:
        snap = copy.deepcopy(e.store)
        self.mode = Mode(**snap["mode"]) if snap["mode"] else None
        self.max_endpoints = snap["max_endpoints"]
        self.endpoints_per_session = snap.get("endpoints_per_session", 0)
        for item in snap["endpoints"]:
            facts = ev.from_plain(EndpointFacts, item["facts"])
            decision = salvage.materializable(facts.checkpoint, self.mode) if self.mode \
                else salvage.Refused("no server mode in the snapshot")
            if not decision.ok:
                raise InvariantViolation(1, e.seq, f"snapshot holds endpoint {facts.id} but "
                                         f"{decision.reason}")
            self._index(facts, item["published_seq"], item["last_used_seq"])

    def _started(self, e: ev.RequestStarted) -> None:
        if e.endpoint is None:
            return
        stored = self.endpoints.get(e.endpoint)
        if stored is None:
            raise InvariantViolation(
                2, e.seq, f"plan reuses endpoint {e.endpoint}, which the store does not hold",
                e.request,
            )
        stored.last_used_seq = e.seq

    def _removed(self, e: ev.EndpointEvicted | ev.EndpointLost) -> None:
        if e.endpoint not in self.endpoints:
            raise InvariantViolation(
                5, e.seq, f"{e.kind} names endpoint {e.endpoint}, which the store does not hold"
            )
        self._drop(e.endpoint)

    def _drop(self, endpoint_id: str | None) -> None:
        stored = self.endpoints.pop(endpoint_id, None) if endpoint_id else None
        if stored is None:
            return
        f = stored.facts
        key = (f.tenant, f.session or "")
        if f.kind == "private":
            ids = self._private[key]
            del ids[endpoint_id]
            if not ids:
                del self._private[key]
        elif f.kind == "anchor":
            self._anchors.get(key, {}).pop(f.position, None)
        else:
            self._shared.get(f.tenant, {}).pop(f.position, None)

    # --- queries ------------------------------------------------------------------------

    def candidates(self, tenant: str, session: str | None) -> list[EndpointFacts]:
        """Endpoints this tenant may plan from, longest first (private before anchor before
        shared at equal positions)."""
        key = (tenant, session or "")
        ids = []
        if session is not None:
            ids.extend(self._private.get(key, ()))
            ids.extend(self._anchors.get(key, {}).values())
        ids.extend(self._shared.get(tenant, {}).values())
        found = [self.endpoints[i].facts for i in ids]
        rank = {"private": 0, "anchor": 1, "shared": 2}
        found.sort(key=lambda f: (-f.position, rank[f.kind]))
        return found

    def by_recency(self) -> list[str]:
        """Endpoint ids, least recently used (planned from, else published) first: the one
        order in which capacity and memory pressure evict."""
        return [s.facts.id for s in sorted(self.endpoints.values(), key=_recency)]

    def least_recently_used(self) -> str | None:
        if not self.endpoints:
            return None
        return min(self.endpoints.values(), key=_recency).facts.id

    def private(self, tenant: str, session: str) -> list[StoredEndpoint]:
        """The private endpoints of one session key (one per branch), in publication order."""
        return [self.endpoints[i] for i in self._private.get((tenant, session), ())]

    def sessions(self) -> list[tuple[str, str]]:
        """The (tenant, session) keys holding private endpoints."""
        return list(self._private)

    def over_capacity(self) -> list[str]:
        """Endpoints to evict, least recently used first, to get back within capacity."""
        excess = len(self.endpoints) - self.max_endpoints
        return self.by_recency()[:excess] if excess > 0 else []

    def checkpoint_ids(self) -> set[str]:
        return {s.facts.checkpoint.id for s in self.endpoints.values()}

    def state(self) -> tuple:
        """Everything the fold determines, for comparing a live store with a replayed one."""
        return (
            self.mode,
            self.max_endpoints,
            self.endpoints_per_session,
            {k: (s.facts, s.published_seq, s.last_used_seq) for k, s in self.endpoints.items()},
            self._private,
            {k: v for k, v in self._anchors.items() if v},
            {k: v for k, v in self._shared.items() if v},
        )

    def snapshot(self) -> dict:
        """Everything the fold holds, as JSON values: `StoreSnapshotted.store`. The indexes
        are not in it: each endpoint occupies exactly one place, which its facts name."""
        return {
            "mode": dataclasses.asdict(self.mode) if self.mode else None,
            "max_endpoints": self.max_endpoints,
            "endpoints_per_session": self.endpoints_per_session,
            "endpoints": [{"facts": dataclasses.asdict(s.facts), "published_seq": s.published_seq,
                           "last_used_seq": s.last_used_seq} for s in self.endpoints.values()],
        }

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ContinuationStore) and self.state() == other.state()

    __hash__ = None  # type: ignore[assignment]

    @classmethod
    def replay(cls, events) -> ContinuationStore:
        store = cls()
        for event in events:
            store.apply(event)
        return store

    @classmethod
    def from_journal(cls, journal) -> ContinuationStore:
        """Replay: the fold of the journal's events (only the kinds the fold reads)."""
        return cls.replay(journal.read(kinds=FOLD_KINDS))


_HANDLERS = {
    ev.ServerStarted: ContinuationStore._server_started,
    ev.EndpointPublished: ContinuationStore._published,
    ev.RequestStarted: ContinuationStore._started,
    ev.EndpointEvicted: ContinuationStore._removed,
    ev.EndpointLost: ContinuationStore._removed,
    ev.StoreSnapshotted: ContinuationStore._snapshotted,
}


def _recency(stored: StoredEndpoint) -> tuple[int, int]:
    return stored.last_used_seq, stored.published_seq


def _plain(value) -> object:
    """JSON's view of `value` (tuples and lists alike), for comparing snapshots."""
    return json.loads(json.dumps(value))

FOLD_KINDS = tuple(cls.kind for cls in _HANDLERS)
