"""The journal-checkable invariants (J in specs/invariants.md), as one incremental check.

`JournalChecker.feed(event)` folds an event into a replica store and per-request
bookkeeping and raises `InvariantViolation` naming the invariant, the seq and the
request. `journal check`, the stateful tests and the simulator all use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from . import events as ev
from .store import ContinuationStore, InvariantViolation

LIVE_STATES = ("Prefilling", "Active", "Finishable")


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


class JournalChecker:
    def __init__(self) -> None:
        self.store = ContinuationStore()
        self.requests: dict[str, _Req] = {}
        self.last_seq = 0
        self.max_concurrency = 0
        self.live = 0
        self.cancelled_sessions: set[tuple[str, str]] = set()
        self.events = 0

    def feed_all(self, events: Iterable[ev.Event]) -> JournalChecker:
        for event in events:
            self.feed(event)
        return self

    def feed(self, e: ev.Event) -> None:
        if isinstance(e, ev.StoreSnapshotted) and self.last_seq == 0:
            self._resume(e)  # a rotated journal: carry on from what its snapshot says
        if e.seq != self.last_seq + 1:
            raise InvariantViolation(4, e.seq, f"seq gap or repeat after {self.last_seq}",
                                     e.request)
        self.last_seq = e.seq
        self.events += 1
        r = None
        if e.request is not None and not isinstance(e, ev.RequestQueued):
            r = self.requests.get(e.request)
            if r is None:
                raise InvariantViolation(4, e.seq, f"{e.kind} for a request never queued",
                                         e.request)
            if r.ended_at:
                raise InvariantViolation(4, e.seq, f"{e.kind} after the request's terminal event "
                                         f"at seq {r.ended_at}", e.request)
        if isinstance(e, ev.RequestStarted):
            self._started(e, r)  # before the fold, which touches the endpoint
        self.store.apply(e)
        handler = _HANDLERS.get(type(e))
        if handler is not None:
            handler(self, e, r)

    def _resume(self, e: ev.StoreSnapshotted) -> None:
        self.last_seq = e.seq - 1
        self.max_concurrency = e.max_concurrency
        for rid, r in e.requests.items():
            self.requests[rid] = _Req(r["tenant"], r["session"], r["prompt_len"], r["state"],
                                      r["outputs"], r["frontier"], r["reuse_base"])
        self.live = sum(r.state in LIVE_STATES for r in self.requests.values())

    def _snapshotted(self, e: ev.StoreSnapshotted, _r) -> None:
        open_ids = {rid for rid, r in self.requests.items() if not r.ended_at}
        if open_ids != set(e.requests):
            raise self._violation(4, e, f"the snapshot's open requests {sorted(e.requests)} "
                                  f"are not the journal's {sorted(open_ids)}")

    def _violation(self, n: int, e: ev.Event, message: str) -> InvariantViolation:
        return InvariantViolation(n, e.seq, message, e.request)

    def _server_started(self, e: ev.ServerStarted, _r) -> None:
        if self.live:
            raise self._violation(4, e, f"{self.live} requests still live at a restart")
        self.max_concurrency = e.max_concurrency

    def _queued(self, e: ev.RequestQueued, _r) -> None:
        if e.request in self.requests:
            raise self._violation(4, e, "request queued twice")
        key = (e.tenant, e.conversation or "")
        self.requests[e.request] = _Req(e.tenant, e.conversation, e.prompt_len,
                                        after_cancel=key in self.cancelled_sessions)

    def _started(self, e: ev.RequestStarted, r: _Req) -> None:
        length = r.prompt_len + r.outputs
        if e.reuse_base >= length:
            raise self._violation(2, e, f"reuse_base {e.reuse_base} >= sequence length {length}")
        if e.endpoint is not None:
            stored = self.store.endpoints.get(e.endpoint)
            if stored is None:
                raise self._violation(2, e, f"plan reuses unknown endpoint {e.endpoint}")
            f = stored.facts
            if f.tenant != r.tenant or (f.kind != "shared" and f.session != r.session):
                raise self._violation(8, e, f"endpoint {f.id} of tenant {f.tenant!r} planned "
                                      f"for tenant {r.tenant!r}")
            if f.position != e.reuse_base:
                raise self._violation(2, e, "reuse_base differs from the endpoint's position")
        r.state, r.reuse_base, r.frontier = "Prefilling", e.reuse_base, e.reuse_base
        self.live += 1
        if self.live > self.max_concurrency:
            raise self._violation(7, e, f"{self.live} requests hold lanes, max_concurrency is "
                                  f"{self.max_concurrency}")

    def _advanced(self, e: ev.PrefillAdvanced, r: _Req) -> None:
        if e.cursor <= r.frontier:
            raise self._violation(9, e, f"prefill cursor {e.cursor} did not advance past "
                                  f"{r.frontier}")
        r.frontier = e.cursor

    def _committed(self, e: ev.TokensCommitted, r: _Req) -> None:
        if not e.committed or e.frontier < r.frontier:
            raise self._violation(9, e, f"frontier went from {r.frontier} to {e.frontier}")
        r.frontier = e.frontier
        r.outputs += e.committed

    @staticmethod
    def _state(new: str):
        def handler(self: JournalChecker, e: ev.Event, r: _Req) -> None:
            if new == "Queued":
                self.live -= 1
            r.state = new
        return handler

    def _terminal(self, e: ev.Event, r: _Req) -> None:
        if r.state in LIVE_STATES:
            self.live -= 1
        r.state, r.ended_at = e.kind, e.seq
        if isinstance(e, ev.RequestFinished) and e.cached_tokens != r.reuse_base:
            raise self._violation(10, e, f"cached_tokens {e.cached_tokens} != plan's reuse_base "
                                  f"{r.reuse_base}")
        if isinstance(e, ev.RequestFailed) and e.failure == "internal":
            where = " after a cancel in its conversation" if r.after_cancel else ""
            raise self._violation(10, e, f"request failed{where}: {e.message}")
        if isinstance(e, ev.RequestCancelled):
            self.cancelled_sessions.add((r.tenant, r.session or ""))


_HANDLERS = {
    ev.ServerStarted: JournalChecker._server_started,
    ev.StoreSnapshotted: JournalChecker._snapshotted,
    ev.RequestQueued: JournalChecker._queued,
    ev.PrefillAdvanced: JournalChecker._advanced,
    ev.TokensCommitted: JournalChecker._committed,
    ev.PrefillCompleted: JournalChecker._state("Active"),
    ev.StopReached: JournalChecker._state("Finishable"),
    ev.RequestPreempted: JournalChecker._state("Queued"),
    ev.RequestFinished: JournalChecker._terminal,
    ev.RequestCancelled: JournalChecker._terminal,
    ev.RequestFailed: JournalChecker._terminal,
}
