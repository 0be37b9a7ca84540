"""The scheduler: who starts, who waits, and what gives way when memory runs out.

Plain bookkeeping over the pools, the store and the lifecycle's requests, torch-free, so
it tests in microseconds like the planner. It decides; the engine carries the decision
out (evicting is an event, preempting and failing are lifecycle triggers) and asks
again, in a loop: no decision here recurses.

Memory pressure is relieved in one order everywhere: the least recently used endpoint
first (the store's own recency, the order its capacity bound evicts in too), then a
detached prefill (work no client waits for) ends, then the newest other lane still
computing is preempted, then the asking lane itself waits (others will finish and free
memory) or, alone, fails.

A detached prefill (a fresh prefill its client cut, going on for the retry) holds its lane
only while no request waits: a waiting request whose prompt extends it adopts it in place
(`adoption.refusal` decides), any other waiting request ends it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from ..lifecycle import adoption
from ..lifecycle.request import Request
from ..lifecycle.store import ContinuationStore
from ..model.pools import BlockPool, SlotPool


class Evict(NamedTuple):
    """Drop this endpoint (the least recently used) and release its storage."""

    endpoint: str


class Preempt(NamedTuple):
    """Send this lane's request back to wait, salvaging what it computed."""

    request: str


class End(NamedTuple):
    """End this detached prefill now, publishing its frontier: its lane or memory is
    needed by a request a client waits for."""

    request: str


class Adopt(NamedTuple):
    """`adopter` (waiting) takes over `detached`'s lane in place."""

    adopter: Request
    detached: Request


class Fail(NamedTuple):
    """The asking request cannot be held even alone."""

    message: str


Relief = Evict | End | Preempt | Fail

# states in which a lane still computes, so that preempting it frees memory for others
PREEMPTIBLE = ("Prefilling", "Active")


class Scheduler:
    def __init__(self, *, max_concurrency: int, draft_tokens: int, blocks: BlockPool,
                 slots: SlotPool, store: ContinuationStore, kv_copies: int = 1) -> None:
        """`kv_copies`: KV entries a position needs (2 under MTP: the main model's and the
        MTP layer's)."""
        self.max_concurrency, self.draft_tokens = max_concurrency, draft_tokens
        self.blocks, self.slots, self.store = blocks, slots, store
        self.kv_copies = kv_copies
        self.waiting: deque[Request] = deque()

    # --- the queue ----------------------------------------------------------------------

    def admit(self, request: Request) -> None:
        self.waiting.append(request)

    def requeue(self, request: Request) -> None:
        """A preempted request waits first in line: it has waited longest."""
        self.waiting.appendleft(request)

    def withdraw(self, request: Request) -> None:
        if request in self.waiting:
            self.waiting.remove(request)

    def next_start(self, live: int) -> Request | None:
        """The request to start now beside `live` running lanes, or None (no lane free, or
        the head of the line does not fit yet: it keeps its place)."""
        if not self.waiting or live >= self.max_concurrency:
            return None
        head = self.waiting[0]
        return head if self.fits(head, live) else None

    def started(self, request: Request) -> None:
        assert self.waiting[0] is request, "only the head of the line starts"
        self.waiting.popleft()

    def adoption(self, detached: Sequence[Request]) -> Adopt | None:
        """A waiting request that adopts one of the `detached` prefills, first in line
        first (it needs no lane of its own, so it may pass the head of the line)."""
        if not detached:  # the common case: nothing to adopt, no walk down the line
            return None
        for request in self.waiting:
            for d in detached:
                if adoption.refusal(d, request) is None:
                    return Adopt(request, d)
        return None

    def displaced(self, detached: Sequence[Request]) -> End | None:
        """The detached prefill that gives its lane up, the oldest first, while a request
        waits that neither adopts it nor could start."""
        return End(detached[0].id) if self.waiting and detached else None

    def fits(self, request: Request, live: int) -> bool:
        """Room for the whole request beside the lanes already running. Alone, a request
        may always start (it evicts endpoints as it goes); beside others it waits, so that
        preempted requests do not come straight back and preempt in turn."""
        if live == 0:
            return True
        positions = len(request.so_far) + request.params.max_tokens + self.draft_tokens
        return self.blocks.free >= self.blocks.blocks_for(positions) * self.kv_copies

    # --- memory pressure -----------------------------------------------------------------

    def evictable(self) -> Evict | None:
        """The least recently used endpoint, if the store holds any."""
        victim = self.store.least_recently_used()
        return None if victim is None else Evict(victim)

    def for_slot(self) -> Evict | None:
        """What gives way for a recurrent-state slot: nothing if one is free, else the
        least recently used endpoint (None: there is no slot to be had now)."""
        return None if self.slots.free else self.evictable()

    def relieve(self, asking: Request, lanes: Sequence[Request], shortfall: str) -> Relief:
        """What gives way when `asking` (one of `lanes`, in start order) needs blocks that
        are not free; `shortfall` says how many (for the failure's message)."""
        evict = self.evictable()
        if evict is not None:
            return evict
        if asking.state == "Detached":
            return End(asking.id)
        detached = [r for r in lanes if r.state == "Detached"]
        if detached:
            return End(detached[0].id)
        others = [r for r in lanes if r is not asking and r.state in PREEMPTIBLE]
        if others:
            return Preempt(others[-1].id)      # the newest: it has computed least
        if len(lanes) > 1:
            return Preempt(asking.id)          # the others will finish and free memory
        return Fail(f"the KV pool cannot hold this request: {shortfall}")

    def over_capacity(self) -> list[str]:
        """Endpoints past the store's capacity, least recently used first."""
        return self.store.over_capacity()
