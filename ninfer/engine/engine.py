"""The engine: the only owner of the lifecycle machine, the store and the journal.

Other threads only enqueue commands (`submit`, `cancel`); `step()` applies them at the
step boundary, schedules lanes, runs one unit of device work per lane and commits the
step's events to the journal as one transaction. A step is never torn: a cancel lands
before or after a step's work, or, through the draft hook, between draft and verify,
where the round is discarded as a whole.

It composes the parts and carries out their decisions: the scheduler (who starts, what
gives way for memory), prefill, speculative rounds, exits (salvage), recovery.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

from ..lifecycle import events as ev
from ..lifecycle import machine, planner
from ..lifecycle.eventlog import EventLog
from ..lifecycle.facts import EndpointFacts, Mode
from ..lifecycle.hashing import starts_with
from ..lifecycle.request import Request
from ..lifecycle.store import ContinuationStore
from ..model.pools import BlockPool, OutOfMemory, SlotPool
from ..model.protocol import MissingStatePart, Model, ModelLost
from .budget import budgeted
from .choice import Choice, make_choice
from .commands import Cancel, EngineConfig, Inbox, Stop, Submit
from .exits import Exits
from .grammar import ConstraintError, Grammars
from .integrity import check_conservation
from .live import Live
from .pacing import PrefillPacing
from .prefill import Prefill
from .recovery import recover, rotate
from .rounds import Rounds
from .runner import Held, ReuseMismatch, Runner
from .scheduler import End, Evict, Preempt, Scheduler
from .speculative import AdaptiveDraft

log = logging.getLogger("ninfer.engine")


class Engine:
    def __init__(self, model: Model, config: EngineConfig, *, blocks: BlockPool,
                 slots: SlotPool, journal=None, held: dict[str, Held] | None = None,
                 clock: Callable[[], float] | None = None, endpoint_files=None,
                 grammars: Grammars | None = None) -> None:
        """`endpoint_files`: an `EndpointFiles` (engine/durable.py) to write published
        checkpoints to and restore them from at `recover`; None keeps them in memory only.
        `grammars`: compiles requests' grammars for the model's tokenizer (engine/grammar.py);
        None refuses constrained requests."""
        self.model, self.config = model, config
        self.blocks, self.slots = blocks, slots
        self.mode = Mode(config.spec, model.identity, model.dtypes)
        self.runner = Runner(model, blocks, slots, self.mode)
        self.store = ContinuationStore()
        self.journal = journal
        kwargs = {"clock": clock} if clock else {}
        self.log = EventLog(self.store, journal, journal_tokens=config.journal_tokens, **kwargs)
        self.held: dict[str, Held] = held if held is not None else {}
        self.files = endpoint_files
        self.requests: dict[str, Request] = {}
        self.live: dict[str, Live] = {}
        self.scheduler = Scheduler(
            max_concurrency=config.max_concurrency, draft_tokens=config.draft_tokens,
            blocks=blocks, slots=slots, store=self.store, kv_copies=2 if self.runner.mtp else 1)
        self.prefill = Prefill(
            self.runner, chunk=config.prefill_chunk, auto_anchors=config.auto_anchors,
            max_context=config.max_context, reserve=self._reserve, free_slot=self._free_slot,
            checkpoint_id=self._next_cp, facts=self._facts)
        self.rounds = Rounds(self.runner, self.mode, max_context=config.max_context,
                             reserve=self._reserve)
        self.exits = Exits(self.runner, self.mode, self.scheduler, self.log, live=self.live,
                           held=self.held, files=endpoint_files, checkpoint_id=self._next_cp,
                           facts=self._facts)
        self.grammars = grammars
        self.commands = Inbox(vocab_size=model.vocab_size, max_context=config.max_context,
                              end_tokens=grammars.end_tokens if grammars else None)
        self.draft_hook: Callable[[Request], bool] | None = None
        # how a request's tokens are chosen; `journal redrive` forces the recorded ones
        self.choose: Callable[[Request], Choice] = lambda r: make_choice(
            r.params, r.outputs, r.prompt, self.grammars)
        self._cp_ids = itertools.count(1)
        self.steps = 0
        self.pacing = PrefillPacing(config.decode_gap, config.prefill_chunk,
                                    smallest=config.paced_from or 16,
                                    clock=clock or time.perf_counter) \
            if config.decode_gap else None

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    def recover(self) -> None:
        """Fold the journal, close what a crash left open, then announce this server."""
        recover(self)
        self._reconcile()
        self._commit()

    # --- commands (any thread) ---------------------------------------------------------

    def submit(self, command: Submit) -> None:
        """Validate (ValueError says what is wrong) and enqueue. Any thread."""
        self.commands.submit(command)

    def reserve_id(self, request_id: str) -> bool:
        """Take a request id; False if it was taken (ids are unique across restarts)."""
        return self.commands.take_id(request_id)

    def cancel(self, request_id: str) -> None:
        self.commands.put(Cancel(request_id))

    def stop_request(self, request_id: str, reason: str = "stop_string") -> None:
        self.commands.put(Stop(request_id, reason))

    # --- the step ----------------------------------------------------------------------

    def step(self) -> list[ev.Event]:
        """One engine step; returns the events it committed. A lost model (a tensor-parallel
        rank gone) fails every request in flight, commits that, and raises: the engine
        cannot go on."""
        try:
            return self._step()
        except ModelLost as exc:
            self._lost(exc)
            raise

    def _lost(self, exc: ModelLost) -> None:
        message = f"the model was lost: {exc}"
        for request in list(self.requests.values()):
            if request.state not in machine.TERMINAL:
                self.exits.fail(request, "interrupted", message)
        self._commit()

    def _step(self) -> list[ev.Event]:
        self.steps += 1
        began = time.perf_counter()
        allocated = self.model.allocator_counts() \
            if self.config.slow_step_s is not None else None   # (the slow-step log's)
        self._drain_commands()
        finishing = [x for x in self.live.values() if _ends_here(x.request)]
        for live in finishing:
            self._guarded(live, self.prefill.catch_up)
        for endpoint_id in self.scheduler.over_capacity():
            self.log.emit(ev.EndpointEvicted, endpoint=endpoint_id, reason="capacity")
        self._schedule()
        decoding = []
        # beside decoding lanes, a long prompt (more than one chunk) is paced: one chunk per
        # step, sized by `pacing`; a prompt of one chunk goes in whole, once
        paced = self.pacing is not None and any(
            x.request.state == "Active" for x in self.live.values())
        if self.pacing is not None:
            self.pacing.begin()
        prefilled, unpaced, chunk_done = 0, False, True
        cursors = {x.request.id: x.request.cursor for x in self.live.values()
                   if x.request.state in ("Prefilling", "Detached")} \
            if self.config.slow_step_s is not None else {}   # (the slow-step log's)
        scheduled = time.perf_counter()
        for live in list(self.live.values()):
            if self.live.get(live.request.id) is not live:
                continue  # preempted by another lane's allocation in this step
            state = live.request.state
            if state == "Prefilling" or (state == "Detached" and live not in finishing):
                long = paced and self._long_prompt(live.request)
                if long and prefilled:
                    continue  # one paced chunk per step
                limit = self.pacing.size if long else None
                cursor = live.request.cursor
                # paced: a part of the chunk's forward a step (the decode steps between)
                self._guarded(live, lambda x, limit=limit, parts=long:
                              self._prefill_step(x, limit, parts))
                if long:   # a part of a chunk counts as the chunk (`PrefillPacing.end`)
                    pending = live.pending
                    prefilled += pending.end - pending.start if pending is not None \
                        else max(live.request.cursor - cursor, 0)
                    chunk_done = pending is None
                else:
                    unpaced = True
            elif live.request.state == "Active":
                self._guarded(live, self._draft)
                decoding.append(live)
        self._verify([x for x in decoding if self.live.get(x.request.id) is x])
        launched = time.perf_counter()
        self.model.synchronize()  # the step commits: its device work has completed
        synced = time.perf_counter()
        advanced = {rid: self.requests[rid].cursor - c for rid, c in cursors.items()
                    if rid in self.requests and self.requests[rid].cursor > c}
        if self.pacing is not None and not unpaced:  # a step that says what a chunk costs
            self.pacing.end(bool(decoding), prefilled, chunk_done)
        for live in finishing:  # a turn's state is published once it is complete and fenced
            if self.live.get(live.request.id) is live:
                trigger = "cancel" if live.request.state == "Detached" else "finish"
                self._guarded(live, lambda x, t=trigger: self.exits.leave(x, t))
        self._reconcile()
        if not self.config.keep_finished:  # a long-running server forgets ended requests
            self.requests = {k: r for k, r in self.requests.items()
                             if r.state not in machine.TERMINAL}
        committing = time.perf_counter()
        events = self._commit()
        if self.config.slow_step_s is not None:
            ended = time.perf_counter()
            if ended - began >= self.config.slow_step_s:
                grew = None if allocated is None else tuple(
                    b - a for a, b in zip(allocated, self.model.allocator_counts(),
                                          strict=True))
                log.info(slow_step(self.steps, began, scheduled, launched, synced, committing,
                                   ended, advanced, len(decoding), len(events), grew))
        return events

    def _commit(self) -> list[ev.Event]:
        """Write the step's events as one transaction; rotate a journal past its size."""
        events = self.log.flush()
        if self.journal is not None and self.journal.full:
            rotate(self)
        return events

    def idle(self) -> bool:
        return not self.live and not self.waiting and self.commands.empty()

    def _drain_commands(self) -> None:
        for command in self.commands.drain():
            if isinstance(command, Submit):
                self._admit(command)
                continue
            request = self.requests.get(command.id)
            if isinstance(command, Stop):
                if request is not None and request.state == "Active":
                    self._stop(request, command.reason)
            elif request is not None and request.state not in (*machine.TERMINAL, "Detached"):
                self._cut(request)

    def _cut(self, request: Request) -> None:
        """A client's cancel: a fresh prefill goes on detached when the engine detaches
        (its client is told now, by PrefillDetached); anything else is cancelled."""
        if self.config.detach_prefills and request.state == "Prefilling" \
                and machine.fire(request, "detach"):
            return
        self.exits.cancel(request)

    def _admit(self, c: Submit) -> None:
        request = Request(
            id=c.id, prompt=c.prompt, session=c.session, tenant=c.tenant, log=self.log,
            mode=self.mode, params=c.params, boundaries=tuple(sorted(set(c.boundaries))),
            shared_prefix=c.shared_prefix, journal_tokens=self.config.journal_tokens,
            hashes=self._known_hashes(c))
        self.requests[c.id] = request
        machine.admit(request)
        self.scheduler.admit(request)

    def _known_hashes(self, c: Submit) -> tuple[int, ...]:
        """The block hashes of the longest held checkpoint the tenant may plan from whose
        tokens begin the prompt (compared in full), so admission hashes only the blocks
        past it: a next turn's prompt is its last turn's and a few new tokens."""
        for endpoint in self.store.candidates(c.tenant, c.session):
            held = self.held.get(endpoint.checkpoint.id)
            n = len(held.tokens) if held is not None else 0
            if n > 0 and starts_with(c.prompt, held.tokens):
                return held.hashes
        return ()

    def _guarded(self, live: Live, work: Callable[[Live], object]) -> None:
        """Run a lane's work; a broken state part fails the request, never the engine."""
        try:
            work(live)
        except (MissingStatePart, KeyError, IndexError) as exc:
            log.error("request %s failed: %s", live.request.id, exc, exc_info=True)
            self._fail_internal(live.request, str(exc))
        except ConstraintError as exc:  # the request's grammar, not the engine, is at fault
            log.warning("request %s failed: %s", live.request.id, exc)
            self.exits.fail(live.request, "invalid", str(exc))

    # --- scheduling and memory: the scheduler decides, the engine carries it out -------

    def _schedule(self) -> None:
        """Adoptions first (they need no lane), then starts in line; a detached prefill
        gives its lane up while a request is left waiting. Each turn of the loop adopts,
        starts or ends one, so it ends."""
        while True:
            detached = [x.request for x in self.live.values() if x.request.state == "Detached"]
            adopt = self.scheduler.adoption(detached)
            if adopt is not None:
                self._adopt(adopt.adopter, self.live[adopt.detached.id])
                continue
            request = self.scheduler.next_start(len(self.live))
            if request is not None and self._start(request):
                self.scheduler.started(request)
                continue
            end = self.scheduler.displaced(detached)
            if end is None:
                return
            self.exits.leave(self.live[end.request], "cancel")

    def _adopt(self, adopter: Request, detached: Live) -> None:
        """`adopter` takes over the detached prefill's lane and captures in place."""
        self.scheduler.withdraw(adopter)
        self.live[adopter.id] = self.exits.adopt(
            detached, adopter, self._drafting(), self._choice(adopter))
        machine.fire(adopter, "start")

    def _choice(self, request: Request) -> Choice:
        """How the request's tokens are chosen: `choose`, under its reasoning budget."""
        return budgeted(self.choose(request), request.params, request.outputs)

    def _start(self, request: Request) -> bool:
        """Plan and materialize; False (and nothing held) when memory is short now."""
        while True:
            if not self._free_slot():
                return False
            live = Live(request, self.runner.new_lane(),
                        self._drafting(), self._choice(request))
            request.plan = planner.plan(request.sequence, request.sequence_hashes, request.tenant,
                                        request.session, self.store, self.mode, self._usable)
            try:
                if request.plan.endpoint is None:
                    self.runner.init_root(live.lane)
                else:
                    self.runner.restore(self.held[request.plan.endpoint.checkpoint.id],
                                        live.lane, self.config.check_reuse)
                break
            except OutOfMemory:
                self.runner.release_lane(live.lane)
                if not self._evict_lru():
                    return False
        request.cursor = request.plan.reuse_base
        self.live[request.id] = live
        machine.fire(request, "start")
        return True

    def _usable(self, endpoint: EndpointFacts) -> str | None:
        held = self.held.get(endpoint.checkpoint.id)
        return None if held is not None else "checkpoint tensors are not held"

    def _reserve(self, live: Live, attn_upto: int, mtp_upto: int = 0) -> bool:
        """Blocks for the lane's next work, relieving memory pressure as the scheduler
        decides; False if this lane gave way instead (preempted or failed)."""
        while True:
            try:
                self.runner.reserve(live.lane, attn_upto, mtp_upto)
                return True
            except OutOfMemory as exc:
                lanes = [x.request for x in self.live.values()]
                relief = self.scheduler.relieve(live.request, lanes, str(exc))
                if isinstance(relief, Evict):
                    self.evict(relief.endpoint, "memory", commit=False)
                elif isinstance(relief, End):
                    self.exits.leave(self.live[relief.request], "cancel")
                elif isinstance(relief, Preempt):
                    self.preempt(relief.request)
                else:
                    self.exits.fail(live.request, "capacity", relief.message)
                if self.live.get(live.request.id) is not live:
                    return False

    def _free_slot(self) -> bool:
        """A recurrent-state slot free, evicting the least recently used endpoint if none
        is; False when neither is possible."""
        relief = self.scheduler.for_slot()
        if relief is not None:
            self.evict(relief.endpoint, "memory", commit=False)
        return self.slots.free > 0

    def _evict_lru(self) -> bool:
        relief = self.scheduler.evictable()
        if relief is None:
            return False
        self.evict(relief.endpoint, "memory", commit=False)
        return True

    def evict(self, endpoint_id: str, reason: str = "operator", *, commit: bool = True) -> None:
        """Drop an endpoint from the store (as an event) and release its storage."""
        self.log.emit(ev.EndpointEvicted, endpoint=endpoint_id, reason=reason)
        self._reconcile()
        if commit:
            self._commit()

    # --- lane work ---------------------------------------------------------------------

    def _long_prompt(self, request: Request) -> bool:
        """More to prefill than one chunk, or than `paced_from` where set (from where its
        plan started it)."""
        base = request.plan.reuse_base if request.plan is not None else 0
        return request.prefill_goal - base > (self.config.paced_from
                                              or self.config.prefill_chunk)

    def _prefill_step(self, live: Live, limit: int | None = None, parts: bool = False) -> None:
        """One prefill chunk of `live`, of at most `limit` prompt tokens (None: a whole
        chunk); `parts`: a part of its forward (`Prefill.step`)."""
        done = self.prefill.step(live, limit, parts)
        if done is not None:
            machine.fire(live.request, "prefilled", first_token=done.first_token)
            if done.stop is not None:
                self._stop(live.request, done.stop)

    def _drafting(self) -> AdaptiveDraft:
        return AdaptiveDraft(self.config.draft_tokens, adaptive=self.config.adaptive_drafting)

    def _draft(self, live: Live) -> None:
        if not self.rounds.draft(live):
            return
        if self.draft_hook is not None and self.draft_hook(live.request):
            self.rounds.discard(live)  # a cut between draft and verify drops the round
            self.exits.cancel(live.request)

    def _verify(self, lives: list[Live]) -> None:
        for verified in self.rounds.verify(lives, self._fail_internal):
            live = verified.live
            if verified.out is None:
                live.round = None
                continue
            self._guarded(live, lambda x, o=verified.out: self._commit_round(x, o))

    def _commit_round(self, live: Live, out) -> None:
        stop = self.rounds.commit(live, out)
        if stop is not None:
            self._stop(live.request, stop)

    def _fail_internal(self, request: Request, message: str) -> None:
        self.exits.fail(request, "internal", message)

    def _stop(self, request: Request, reason: str) -> None:
        request.stop_reason = reason
        machine.fire(request, "stop")

    def preempt(self, request_id: str) -> None:
        """Send a computing lane's request back to wait (memory pressure does this; tests
        and the state machine do it at will)."""
        self.exits.preempt(self.live[request_id])

    # --- bookkeeping -------------------------------------------------------------------

    def _next_cp(self, request: Request) -> str:
        return f"{request.id}#{next(self._cp_ids)}"

    def _facts(self, held: Held):
        return held.facts(self.model, self.config.journal_tokens)

    def _reconcile(self) -> None:
        self.exits.reconcile()

    def check_integrity(self) -> None:
        """Invariant 6, conservation: pool use equals what lanes and endpoints hold."""
        check_conservation(self.blocks, self.slots, self.held, self.live.values(), self.store)

    def close_for_restart(self) -> dict[str, Held]:
        """A crash: live lanes and captures vanish; published checkpoints' storage is
        returned for a restart that keeps tensors (unflushed events are lost)."""
        for live in self.live.values():
            self.exits.release(live)
        self.live.clear()
        return self.held


def slow_step(step: int, began: float, scheduled: float, launched: float, synced: float,
              committing: float, ended: float, prefilled: dict[str, int], decoding: int,
              events: int, allocated: tuple[int, int] | None = None) -> str:
    """A slow step's log line: where its time went, and what it did; `allocated`: the
    device memory segments and allocation retries it added (`allocator_counts`), named
    where not zero."""
    def ms(a: float, b: float) -> str:
        return f"{1e3 * (b - a):.1f}"
    what = ", ".join(f"{n:,} of req#{rid}" for rid, n in sorted(prefilled.items())) or "nothing"
    memory = "" if not allocated or not any(allocated) else (
        f"; device memory: {allocated[0]} segments allocated, {allocated[1]} allocations "
        f"retried after freeing the cache")
    return (f"slow step {step}: {ms(began, ended)} ms (admitting {ms(began, scheduled)}, "
            f"launching {ms(scheduled, launched)}, device wait {ms(launched, synced)}, "
            f"publishing {ms(synced, committing)}, journal {ms(committing, ended)}); "
            f"prefilled {what}; {decoding} lanes decoding; {events} events{memory}")


def _ends_here(request: Request) -> bool:
    """Leaves its lane at this step's end: a finished turn, or a detached prefill at its
    goal (each publishes its frontier once complete and fenced)."""
    return request.state == "Finishable" or (request.state == "Detached"
                                             and request.cursor >= request.detached_goal)


def run_until_idle(engine: Engine, max_steps: int = 100_000) -> int:
    steps = 0
    while not engine.idle() and steps < max_steps:
        engine.step()
        steps += 1
    return steps


def make_sim_engine(config: EngineConfig, *, num_blocks: int = 256, block_size: int = 4,
                    num_slots: int = 32, journal=None, seed: int = 0) -> Engine:
    from ..model.sim_model import SimModel
    model = SimModel(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, seed=seed)
    engine = Engine(model, config, blocks=BlockPool(num_blocks, block_size),
                    slots=SlotPool(num_slots), journal=journal)
    engine.recover()
    return engine


__all__ = ["Engine", "EngineConfig", "Submit", "Cancel", "Stop", "ReuseMismatch",
           "run_until_idle", "make_sim_engine"]
