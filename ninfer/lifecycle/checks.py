"""The journal-checkable invariants (J in specs/invariants.md), as one incremental check.

`JournalChecker.feed(event)` folds an event into a replica store and per-request
bookkeeping and raises `InvariantViolation` naming the invariant, the seq and the
request. `journal check`, the stateful tests and the simulator all use it.

It is two checkers with disjoint duties, so that `journal check` can run them side by side
in two processes over the same file:

- `RequestChecks`, each request against its own events: queued once, nothing after its
  terminal event, a plan inside its sequence, prefill and commits moving forward, the
  finish's cached tokens, no internal failure. It reads few fields of few kinds, and reads
  them by attribute, so it takes an event or a `PayloadView` of its JSON alike.
- `StoreChecks`, the server as a whole: seqs gap-free, the store's fold (publication,
  eviction, restarts, snapshots), a session key's evictions made by its rule
  (lifecycle/conversation.py), plans that name held endpoints of their own tenant, lanes
  within max_concurrency, no live request across a restart.

`JournalChecker.feed` runs them in the order a single checker would: the gap first, then the
request's own checks, then the store's; `journal check` picks, of the two first violations,
the one at the smaller seq (at equal seqs, in that same order).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from . import events as ev
from .conversation import SESSION_BOUND, SUPERSEDED, least_recently_used, may_extend
from .store import FOLD_KINDS, ContinuationStore, InvariantViolation

LIVE_STATES = ("Prefilling", "Active", "Finishable")


class PayloadView:
    """An event's payload read as attributes, without building the event: what
    `RequestChecks` needs of the kinds it reads. `view = PayloadView(); view.__dict__ =
    payload` (no copy); a field the payload lacks is an AttributeError naming it."""

    @classmethod
    def of(cls, payload: dict) -> PayloadView:
        view = object.__new__(cls)
        view.__dict__ = payload
        return view


def _violation(n: int, e, message: str) -> InvariantViolation:
    return InvariantViolation(n, e.seq, message, e.request)


@dataclass(slots=True)
class _Req:
    tenant: str
    session: str | None
    prompt_len: int
    state: str = "Queued"
    outputs: int = 0
    frontier: int = 0
    reuse_base: int = 0
    ended_at: int = 0
    after_cancel: bool = False   # an earlier request of its conversation was cancelled


class RequestChecks:
    """Invariants each request's own events keep (2, 4, 9, 10 in part)."""

    def __init__(self) -> None:
        self.requests: dict[str, _Req] = {}
        self.cancelled_sessions: set[tuple[str, str]] = set()

    def resume(self, e: ev.StoreSnapshotted) -> None:
        for rid, r in e.requests.items():
            self.requests[rid] = _Req(r["tenant"], r["session"], r["prompt_len"], r["state"],
                                      r["outputs"], r["frontier"], r["reuse_base"])

    def feed(self, e, kind: str) -> None:
        """`e`: an event of `kind`, or a PayloadView of one (with its envelope). First the
        request it belongs to must be open (invariant 4); then the kind's own checks."""
        r = None
        if e.request is not None and kind != "RequestQueued":
            r = self.open(kind, e.seq, e.request)
        handler = _REQUEST_HANDLERS.get(kind)
        if handler is not None:
            handler(self, e, r)

    def open(self, kind: str, seq: int, request: str) -> _Req:
        """The request an event of `kind` at `seq` belongs to, which must be open."""
        r = self.requests.get(request)
        if r is None:
            raise InvariantViolation(4, seq, f"{kind} for a request never queued", request)
        if r.ended_at:
            raise InvariantViolation(4, seq, f"{kind} after the request's terminal event at "
                                     f"seq {r.ended_at}", request)
        return r

    # each kind's checks on the values they read: `feed` takes them from an event, journal
    # check from the columns SQLite extracts of the most common kinds
    def _queued(self, e, _r) -> None:
        self.queued(e.seq, e.request, e.tenant, e.conversation, e.prompt_len)

    def queued(self, seq: int, request: str, tenant: str, conversation: str | None,
               prompt_len: int) -> None:
        if request in self.requests:
            raise InvariantViolation(4, seq, "request queued twice", request)
        self.requests[request] = _Req(tenant, conversation, prompt_len, after_cancel=(
            tenant, conversation or "") in self.cancelled_sessions)

    def _started(self, e, r: _Req) -> None:
        self.started(r, e.seq, e.request, e.reuse_base)

    @staticmethod
    def started(r: _Req, seq: int, request: str, reuse_base: int) -> None:
        length = r.prompt_len + r.outputs
        if reuse_base >= length:
            raise InvariantViolation(2, seq, f"reuse_base {reuse_base} >= sequence length "
                                     f"{length}", request)
        r.state, r.reuse_base, r.frontier = "Prefilling", reuse_base, reuse_base

    def _advanced(self, e, r: _Req) -> None:
        self.advanced(r, e.seq, e.request, e.cursor)

    @staticmethod
    def advanced(r: _Req, seq: int, request: str, cursor: int) -> None:
        if cursor <= r.frontier:
            raise InvariantViolation(9, seq, f"prefill cursor {cursor} did not advance past "
                                     f"{r.frontier}", request)
        r.frontier = cursor

    def _committed(self, e, r: _Req) -> None:
        self.commit(r, e.seq, e.request, e.frontier,
                    ev.committed_count(e.tokens, getattr(e, "count", None)))

    @staticmethod
    def commit(r: _Req, seq: int, request: str, frontier: int, n: int) -> None:
        """A TokensCommitted of `n` tokens: some, and forward, never for a cut prefill."""
        if r.state == "Detached":
            raise InvariantViolation(12, seq, "tokens committed by a detached prefill", request)
        if not n or frontier < r.frontier:
            raise InvariantViolation(9, seq, f"frontier went from {r.frontier} to {frontier}",
                                     request)
        r.frontier = frontier
        r.outputs += n

    def _finished(self, e, r: _Req) -> None:
        self.finished(r, e.seq, e.request, e.cached_tokens)

    @staticmethod
    def finished(r: _Req, seq: int, request: str, cached_tokens: int) -> None:
        r.state, r.ended_at = "RequestFinished", seq
        if cached_tokens != r.reuse_base:
            raise InvariantViolation(10, seq, f"cached_tokens {cached_tokens} != plan's "
                                     f"reuse_base {r.reuse_base}", request)

    @staticmethod
    def _state(new: str):
        def handler(self: RequestChecks, e, r: _Req) -> None:
            r.state = new
        return handler

    def _failed(self, e, r: _Req) -> None:
        self._ended(e, r, "RequestFailed")
        if e.failure == "internal":
            where = " after a cancel in its conversation" if r.after_cancel else ""
            raise _violation(10, e, f"request failed{where}: {e.message}")

    def _cancelled(self, e, r: _Req) -> None:
        self._ended(e, r, "RequestCancelled")
        self.cancelled_sessions.add((r.tenant, r.session or ""))

    @staticmethod
    def _ended(e, r: _Req, kind: str) -> None:
        r.state, r.ended_at = kind, e.seq


_REQUEST_HANDLERS = {
    "RequestQueued": RequestChecks._queued,
    "RequestStarted": RequestChecks._started,
    "PrefillAdvanced": RequestChecks._advanced,
    "TokensCommitted": RequestChecks._committed,
    "PrefillCompleted": RequestChecks._state("Active"),
    "PrefillDetached": RequestChecks._state("Detached"),
    "StopReached": RequestChecks._state("Finishable"),
    "RequestPreempted": RequestChecks._state("Queued"),
    "RequestFinished": RequestChecks._finished,
    "RequestCancelled": RequestChecks._cancelled,
    "RequestFailed": RequestChecks._failed,
}
# the kinds whose payload RequestChecks reads (the others: only their kind and request)
REQUEST_KINDS = frozenset(k for k in _REQUEST_HANDLERS
                          if k not in ("PrefillCompleted", "StopReached", "RequestPreempted",
                                       "RequestCancelled", "PrefillDetached"))


@dataclass(slots=True)
class _Held:
    tenant: str
    session: str | None
    live: bool = False
    ended: bool = False
    adopted_by: str | None = None     # a detached prefill handed over to this request
    adopted_at: int = 0               # at this cursor


class StoreChecks:
    """Invariants of the server as a whole (1, 2, 4, 5, 7, 8, 11 in part), over the store's
    fold."""

    def __init__(self, contiguous: bool = True) -> None:
        """`contiguous` False: fed only some events (journal check's store pass, beside a
        scan that finds gaps), seqs need only increase."""
        self.contiguous = contiguous
        self.store = ContinuationStore()
        self.requests: dict[str, _Held] = {}
        self.last_seq = 0
        self.max_concurrency = 0
        self.live = 0
        self.events = 0

    def enter(self, seq: int, request: str | None) -> None:
        """Every event, first: seqs follow each other (invariant 4)."""
        if seq != self.last_seq + 1 and (self.contiguous or seq <= self.last_seq):
            raise InvariantViolation(4, seq, f"seq gap or repeat after {self.last_seq}", request)
        self.last_seq = seq
        self.events += 1

    def resume(self, e: ev.StoreSnapshotted) -> None:
        self.last_seq = e.seq - 1
        self.max_concurrency = e.max_concurrency
        for rid, r in e.requests.items():
            self.requests[rid] = _Held(r["tenant"], r["session"], r["state"] in LIVE_STATES)
        self.live = sum(r.live for r in self.requests.values())

    def feed(self, e: ev.Event) -> None:
        """An event the store folds, or one that changes which requests hold lanes (after
        `enter`)."""
        handler = _STORE_HANDLERS.get(type(e))
        if handler is not None:
            handler(self, e)
        self.store.apply(e)
        after = _AFTER_FOLD.get(type(e))
        if after is not None:
            after(self, e)

    def skip(self, seq: int, kind: str, request: str | None) -> None:
        """An event of a kind outside STORE_KINDS, read by its kind alone: `enter`, then a
        request leaving its lane (a preemption, a terminal event), or nothing but the
        store's seq. Only the gap can be violated here."""
        if seq != self.last_seq + 1 and (self.contiguous or seq <= self.last_seq):
            raise InvariantViolation(4, seq, f"seq gap or repeat after {self.last_seq}", request)
        self.last_seq = seq
        self.events += 1
        self.store.applied_seq = seq  # what the fold does with a kind it ignores
        if kind in LEAVING_KINDS:
            r = self.requests.get(request)
            if r is not None and not r.ended:
                if r.live:
                    self.live -= 1
                    r.live = False
                r.ended = kind != "RequestPreempted"

    def queued(self, e) -> None:
        """A request queued (an event or a PayloadView of its tenant)."""
        self.requests.setdefault(e.request, _Held(e.tenant, e.conversation))

    def _started(self, e: ev.RequestStarted) -> None:
        r = self.requests.get(e.request)
        if e.plan == "Adopted":
            self._adoption(e, r)
        if e.endpoint is not None:
            stored = self.store.endpoints.get(e.endpoint)
            if stored is None:
                raise _violation(2, e, f"plan reuses unknown endpoint {e.endpoint}")
            f = stored.facts
            if r is not None and (f.tenant != r.tenant
                                  or (f.kind != "shared" and f.session != r.session)):
                raise _violation(8, e, f"endpoint {f.id} of tenant {f.tenant!r} planned "
                                 f"for tenant {r.tenant!r}")
            if f.position != e.reuse_base:
                raise _violation(2, e, "reuse_base differs from the endpoint's position")
        if r is not None and not r.live:
            r.live = True
            self.live += 1
        if self.live > self.max_concurrency:
            raise _violation(7, e, f"{self.live} requests hold lanes, max_concurrency is "
                             f"{self.max_concurrency}")

    def _adopted(self, e: ev.PrefillAdopted) -> None:
        r = self.requests.get(e.request)
        if r is not None:
            r.adopted_by, r.adopted_at = e.by, e.cursor

    def _adoption(self, e: ev.RequestStarted, r: _Held | None) -> None:
        """An Adopted plan takes over a prefill detached by the same tenant, handed to this
        request, at the cursor it was handed over at."""
        a = self.requests.get(e.adopted) if e.adopted is not None else None
        if a is None or a.adopted_by != e.request or e.endpoint is not None:
            raise _violation(2, e, f"plan adopts {e.adopted}, which was not handed to it")
        if r is not None and a.tenant != r.tenant:
            raise _violation(8, e, f"a prefill of tenant {a.tenant!r} adopted by tenant "
                             f"{r.tenant!r}")
        if e.reuse_base != a.adopted_at:
            raise _violation(2, e, f"reuse_base {e.reuse_base} is not the adopted cursor "
                             f"{a.adopted_at}")
    def _evicted(self, e: ev.EndpointEvicted) -> None:
        """A conversation's eviction (lifecycle/conversation.py) is one its rule makes: a
        superseded endpoint is extended by a later one of its key (as far as the facts
        tell), a bound's victim is the least recently used of a key over its bound."""
        stored = self.store.endpoints.get(e.endpoint)
        if e.reason not in (SUPERSEDED, SESSION_BOUND) or stored is None:
            return  # an unknown endpoint is the fold's violation
        f = stored.facts
        if f.kind != "private":
            raise _violation(11, e, f"{e.reason} eviction of {f.kind} endpoint {f.id}")
        points = self.store.private(f.tenant, f.session or "")
        if e.reason == SUPERSEDED:
            if not any(p.published_seq > stored.published_seq and may_extend(p.facts, f)
                       for p in points):
                raise _violation(11, e, f"endpoint {f.id} evicted as superseded, but no later "
                                 "endpoint of its session key extends it")
            return
        bound = self.store.endpoints_per_session
        if len(points) <= bound:
            raise _violation(11, e, f"endpoint {f.id} evicted past the bound, but its session "
                             f"key holds {len(points)} of {bound}")
        if least_recently_used(stored) != min(map(least_recently_used, points)):
            raise _violation(11, e, f"endpoint {f.id} evicted past the bound, but it is not "
                             "its session key's least recently used")

    def _server_started(self, e: ev.ServerStarted) -> None:
        if self.live:
            raise _violation(4, e, f"{self.live} requests still live at a restart")
        self.max_concurrency = e.max_concurrency

    def _snapshotted(self, e: ev.StoreSnapshotted) -> None:
        open_ids = {rid for rid, r in self.requests.items() if not r.ended}
        if open_ids != set(e.requests):
            raise _violation(4, e, f"the snapshot's open requests {sorted(e.requests)} are "
                             f"not the journal's {sorted(open_ids)}")


# the kinds that free a request's lane
LEAVING_KINDS = frozenset({"RequestPreempted", *ev.TERMINAL_KINDS})
_STORE_HANDLERS = {  # before the fold, which touches the endpoint
    ev.RequestQueued: StoreChecks.queued,
    ev.RequestStarted: StoreChecks._started,
    ev.PrefillAdopted: StoreChecks._adopted,
    ev.EndpointEvicted: StoreChecks._evicted,
}
_AFTER_FOLD = {
    ev.ServerStarted: StoreChecks._server_started,
    ev.StoreSnapshotted: StoreChecks._snapshotted,
}
# the kinds StoreChecks decodes; every other kind it reads by kind and request (`lane`)
STORE_KINDS = frozenset({"RequestQueued", "PrefillAdopted", *(t.kind for t in _AFTER_FOLD),
                         *FOLD_KINDS})


class JournalChecker:
    """Both checkers fed event by event, as the stateful tests and the simulator use them."""

    def __init__(self) -> None:
        self.fold = StoreChecks()
        self.progress = RequestChecks()

    @property
    def store(self) -> ContinuationStore:
        return self.fold.store

    @property
    def requests(self) -> dict[str, _Req]:
        return self.progress.requests

    @property
    def last_seq(self) -> int:
        return self.fold.last_seq

    @property
    def events(self) -> int:
        return self.fold.events

    def feed_all(self, events: Iterable[ev.Event]) -> JournalChecker:
        for event in events:
            self.feed(event)
        return self

    def feed(self, e: ev.Event) -> None:
        if isinstance(e, ev.StoreSnapshotted) and self.fold.last_seq == 0:
            self.fold.resume(e)  # a rotated journal: carry on from what its snapshot says
            self.progress.resume(e)
        if e.kind in STORE_KINDS:
            self.fold.enter(e.seq, e.request)
            self.progress.feed(e, e.kind)
            self.fold.feed(e)
        else:  # the gap first, as for the others
            self.fold.skip(e.seq, e.kind, e.request)
            self.progress.feed(e, e.kind)
