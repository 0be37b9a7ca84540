"""How a request leaves its lane: finish, cancel and preempt salvage, fail does not, and a
detached prefill hands its lane to its adopter. What leaves is released, or kept where the
store holds it.

Salvage is an explicit decision: the leaving request's frontier is handed over to a
checkpoint, every candidate is judged by the one predicate (`salvage.decide`), and the
decision is the trigger's argument. The lifecycle's guards only read it; the emitters
publish and refuse exactly what it says; afterwards what was published is kept and the
rest released.
"""

from __future__ import annotations

from collections.abc import Callable

from ..lifecycle import conversation, machine, salvage
from ..lifecycle import events as ev
from ..lifecycle.eventlog import EventLog
from ..lifecycle.facts import CheckpointFacts, EndpointFacts, Mode
from ..lifecycle.hashing import starts_with
from ..lifecycle.planner import Plan
from ..lifecycle.request import Request
from ..lifecycle.salvage import Candidate
from .choice import Choice
from .live import Live
from .runner import Held, Runner
from .scheduler import Scheduler
from .speculative import AdaptiveDraft


class Exits:
    def __init__(self, runner: Runner, mode: Mode, scheduler: Scheduler, log: EventLog, *,
                 live: dict[str, Live], held: dict[str, Held], files,
                 checkpoint_id: Callable[[Request], str],
                 facts: Callable[[Held], CheckpointFacts]) -> None:
        """`live` and `held` are the engine's own maps (lanes by request id, published
        checkpoints by id); `files` writes published checkpoints durably (None: don't)."""
        self.runner, self.mode, self.scheduler, self.log = runner, mode, scheduler, log
        self.live, self.held, self.files = live, held, files
        self.checkpoint_id, self.facts = checkpoint_id, facts

    def offer(self, live: Live) -> list[Candidate]:
        """What a leaving request offers for publication: its frontier first (the lane's
        own storage, handed over to a checkpoint now), then the captures."""
        request = live.request
        if request.cursor > 0 and live.lane.slot >= 0:
            held = self.runner.hand_over(live.lane, self.checkpoint_id(request),
                                         request.so_far[:request.cursor],
                                         request.sequence_hashes)
            live.captures.insert(0, held)
        out = [Candidate(held.role, self.facts(held)) for held in live.captures
               if held.role != "fallback"]
        out.extend(Candidate("fallback", self.facts(h))
                   for h in reversed(live.captures) if h.role == "fallback")
        return out

    def leave(self, live: Live, trigger: str) -> None:
        """Decide the salvage, fire the trigger with it, then keep what was published and
        release the rest."""
        request = live.request
        self.live.pop(request.id, None)
        live.drop_pending()   # its frontier stays at the cursor: nothing of it was accepted
        decision = salvage.decide(self.offer(live), self.mode, request.tenant,
                                  request.session)
        machine.fire(request, trigger, salvage=decision)
        published = {e.checkpoint.id for e in decision.published}
        for held in live.captures:
            if held.id in published:
                self.held[held.id] = held
                if self.files is not None:
                    self.files.save(self.runner.model, held)
            else:
                self.runner.release_held(held)
        live.captures.clear()
        self.runner.release_lane(live.lane)
        self.evict_within_session(request.tenant, request.session)

    def evict_within_session(self, tenant: str, session: str | None) -> None:
        """Keep one session key's private endpoints distinct branches within its bound
        (lifecycle/conversation.py): evict, as events, those a later one extends
        (`superseded`), then the least recently used past the bound (`session_bound`)."""
        if session is None:
            return

        def extends(newer: EndpointFacts, older: EndpointFacts) -> bool:
            a, b = self.held[newer.checkpoint.id], self.held[older.checkpoint.id]
            return starts_with(a.tokens, b.tokens, a.hashes, b.hashes)

        store = self.scheduler.store
        for victim in conversation.evictions(store.private(tenant, session),
                                             store.endpoints_per_session, extends):
            self.log.emit(ev.EndpointEvicted, conversation=session, endpoint=victim.endpoint,
                          reason=victim.reason)

    def cancel(self, request: Request) -> None:
        live = self.live.get(request.id)
        if live is None:  # still waiting: it computed nothing, there is nothing to salvage
            self.scheduler.withdraw(request)
            machine.fire(request, "cancel")
            return
        self.leave(live, "cancel")

    def preempt(self, live: Live) -> None:
        self.leave(live, "preempt")
        self.scheduler.requeue(live.request)

    def fail(self, request: Request, failure: str, message: str) -> None:
        live = self.live.pop(request.id, None)
        self.scheduler.withdraw(request)
        machine.fire(request, "fail", failure=failure, message=message)
        if live is not None:
            self.release(live)

    def adopt(self, detached: Live, adopter: Request, drafting: AdaptiveDraft,
              choice: Choice) -> Live:
        """The detached prefill ends, adopted (nothing published: the lane goes on); the
        adopter's lane, holding its storage and captures, planned at its cursor. The
        adopter's `start` is the caller's to fire."""
        old = detached.request
        del self.live[old.id]
        detached.drop_pending()   # the adopter goes on from the cursor
        taken = machine.fire(old, "adopt", adopter=adopter)
        assert taken, "the scheduler and the adopt guard apply one rule"
        adopter.plan = Plan("Adopted", None, old.cursor, adopted=old.id)
        adopter.cursor = old.cursor
        return Live(adopter, detached.lane, drafting, choice, captures=detached.captures)

    def reconcile(self) -> None:
        """Release checkpoints the store no longer holds (superseded, evicted, lost)."""
        wanted = self.scheduler.store.checkpoint_ids()
        for cp_id in [c for c in self.held if c not in wanted]:
            self.runner.release_held(self.held.pop(cp_id))
            if self.files is not None:
                self.files.delete(cp_id)

    def release(self, live: Live) -> None:
        """Give back a lane and its captures, publishing nothing."""
        live.drop_pending()
        for held in live.captures:
            self.runner.release_held(held)
        live.captures.clear()
        self.runner.release_lane(live.lane)
