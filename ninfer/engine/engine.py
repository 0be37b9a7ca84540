"""The engine: the only owner of the lifecycle machine, the store and the journal.

Other threads only enqueue commands (`submit`, `cancel`); `step()` applies them at the
step boundary, schedules lanes, runs one unit of device work per lane and commits the
step's events to the journal as one transaction. A step is never torn: a cancel lands
before or after a step's work, or, through the draft hook, between draft and verify,
where the round is discarded as a whole.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..lifecycle import conversation, machine, planner, salvage
from ..lifecycle import events as ev
from ..lifecycle.eventlog import EventLog
from ..lifecycle.facts import EndpointFacts, Mode
from ..lifecycle.hashing import block_hashes
from ..lifecycle.request import Request, SamplingParams
from ..lifecycle.salvage import Candidate
from ..lifecycle.store import FOLD_KINDS, ContinuationStore
from .choice import Choice, GreedyChoice, make_choice
from .model import Lane, MissingStatePart, Model
from .pools import BlockPool, OutOfMemory, SlotPool
from .runner import Held, ReuseMismatch, Runner
from .speculative import AdaptiveDraft, truncate

log = logging.getLogger("ninfer.engine")

# most committed positions the MTP layer may lag while drafting pauses: more than a pause
# lasts (AdaptiveDraft's 32 rounds), so it catches up once, for the probe that ends it (each
# catch-up is an eager MTP forward; on an H100 catching up every 64 rather than 16 tokens
# decoded 1.07x faster with drafting paused: bench/results/mtp-paused-h100.json)
MTP_BATCH = 64


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 2
    prefill_chunk: int = 16
    spec: str = "none"               # none | mtp | ngram
    draft_tokens: int = 3
    max_endpoints: int = 16
    endpoints_per_session: int = 4   # private endpoints (branches) one session key holds
    max_context: int = 4096
    auto_anchors: int = 2            # anchors at up to N of the last message boundaries
    journal_tokens: bool = True      # journal token ids, not only block hashes
    check_reuse: bool = False        # compare every restore with a recomputation (tests)
    keep_finished: bool = True       # keep ended requests in `requests` (tests inspect them)

    def __post_init__(self) -> None:
        if self.endpoints_per_session < 1:  # 0 is what older journals record: "one, replaced"
            raise ValueError("endpoints_per_session must be at least 1")


@dataclass(frozen=True)
class Submit:
    id: str
    prompt: tuple[int, ...]
    session: str | None
    tenant: str
    params: SamplingParams
    boundaries: tuple[int, ...] = ()
    shared_prefix: int = 0


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Stop:
    """End an active request as if it had stopped by itself (a stop string the server
    found in the text): it finishes and publishes, unlike a cancel."""

    id: str
    reason: str = "stop_string"


@dataclass(eq=False)
class Live:
    """A request holding a lane."""

    request: Request
    lane: Lane
    drafting: AdaptiveDraft
    choice: Choice
    captures: list[Held] = field(default_factory=list)
    round: tuple | None = None   # (frontier, room, drafts, draft probs) between the halves


class Engine:
    def __init__(self, model: Model, config: EngineConfig, *, blocks: BlockPool,
                 slots: SlotPool, journal=None, held: dict[str, Held] | None = None,
                 clock: Callable[[], float] | None = None, endpoint_files=None) -> None:
        """`endpoint_files`: an `EndpointFiles` (engine/durable.py) to write published
        checkpoints to and restore them from at `recover`; None keeps them in memory only."""
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
        self.waiting: deque[Request] = deque()
        self.live: dict[str, Live] = {}
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.draft_hook: Callable[[Request], bool] | None = None
        # how a request's tokens are chosen; `journal redrive` forces the recorded ones
        self.choose: Callable[[Request], Choice] = lambda r: make_choice(r.params, r.outputs,
                                                                           r.prompt)
        self._cp_ids = itertools.count(1)
        self._ids: set[str] = set()
        self._ids_lock = threading.Lock()
        self.steps = 0

    # --- start-up and recovery ---------------------------------------------------------

    def recover(self) -> None:
        """Fold the journal, close what a crash left open, then announce this server."""
        self.model.synchronize()  # a (re)starting server has no work in flight
        open_requests: dict[str, str | None] = {}
        if self.journal is not None:
            for event in self.journal.read(kinds=FOLD_KINDS):  # what recovery needs
                self.store.apply(event)
                if isinstance(event, ev.StoreSnapshotted):  # a rotated journal's opening
                    for rid, r in event.requests.items():
                        open_requests[rid] = r["session"]
                        self._ids.add(rid)
            # then who came and went, without their payloads (a snapshot opens the file)
            for _, rid, conversation, kind in self.journal.envelopes(
                    ("RequestQueued", *ev.TERMINAL_KINDS)):
                if kind == "RequestQueued":
                    open_requests[rid] = conversation
                    self._ids.add(rid)  # ids stay unique across restarts
                else:
                    open_requests.pop(rid, None)
            self.log.seq = self.journal.last_seq
        for rid, conversation in open_requests.items():
            self.log.emit(ev.RequestFailed, request=rid, conversation=conversation,
                          failure="interrupted", message="server stopped before it ended")
        for endpoint_id, stored in list(self.store.endpoints.items()):
            cp = stored.facts.checkpoint
            decision = salvage.materializable(cp, self.mode)
            reason = None if decision.ok else decision.reason
            if reason is None and cp.id not in self.held:
                reason = self._restore_file(cp)
            if reason:
                self.log.emit(ev.EndpointLost, endpoint=endpoint_id, reason=reason)
        if self.files is not None:
            self.model.synchronize()  # restored parts are written before anything reads them
            self.files.prune(self.store.checkpoint_ids())
        self.log.emit(ev.ServerStarted, mode=self.mode,
                      max_concurrency=self.config.max_concurrency,
                      max_endpoints=self.config.max_endpoints,
                      endpoints_per_session=self.config.endpoints_per_session,
                      options={"prefill_chunk": self.config.prefill_chunk,
                               "draft_tokens": self.config.draft_tokens,
                               "block_size": self.blocks.block_size,
                               "auto_anchors": self.config.auto_anchors,
                               "max_context": self.config.max_context})
        for tenant, session in self.store.sessions():  # a restart may have lowered the bound
            self._evict_within_session(tenant, session)
        self._reconcile()
        self._commit()

    def _restore_file(self, cp) -> str | None:
        """Bring a checkpoint back from its durable file; the reason it is lost, or None."""
        if self.files is None:
            return "tensors did not survive the restart"
        from .durable import FileRefused
        try:
            self.held[cp.id] = self.files.restore(self.model, self.runner, cp)
        except FileRefused as exc:
            return str(exc)
        except OutOfMemory as exc:
            return f"no room to restore it: {exc}"
        return None

    # --- commands (any thread) ---------------------------------------------------------

    def submit(self, command: Submit) -> None:
        """Validate (ValueError says what is wrong) and enqueue. Any thread."""
        problem = self.validate(command)
        if problem:
            raise ValueError(problem)
        with self._ids_lock:
            if command.id in self._ids:
                raise ValueError(f"request id {command.id} is already in use")
            self._ids.add(command.id)
        self.commands.put(command)

    def cancel(self, request_id: str) -> None:
        self.commands.put(Cancel(request_id))

    def stop_request(self, request_id: str, reason: str = "stop_string") -> None:
        self.commands.put(Stop(request_id, reason))

    def validate(self, c: Submit) -> str | None:
        if not c.prompt:
            return "prompt is empty"
        if any(not 0 <= t < self.model.vocab_size for t in c.prompt):
            return f"token ids must be in [0, {self.model.vocab_size})"
        if len(c.prompt) >= self.config.max_context:
            return f"prompt of {len(c.prompt)} tokens exceeds max_context {self.config.max_context}"
        if c.params.max_tokens < 1:
            return "max_tokens must be at least 1"
        if any(not 0 < b <= len(c.prompt) for b in c.boundaries):
            return "message boundaries must lie within the prompt"
        if not 0 <= c.shared_prefix <= len(c.prompt):
            return "shared_prefix must lie within the prompt"
        return None

    # --- the step ----------------------------------------------------------------------

    def step(self) -> list[ev.Event]:
        """One engine step; returns the events it committed."""
        self.steps += 1
        self._drain_commands()
        finishing = [x for x in self.live.values() if x.request.state == "Finishable"]
        for live in finishing:
            self._guarded(live, self._catch_up)
        self._evict_over_capacity()
        self._schedule()
        decoding = []
        for live in list(self.live.values()):
            if live.request.id not in self.live:
                continue  # preempted by another lane's allocation in this step
            if live.request.state == "Prefilling":
                self._guarded(live, self._prefill_step)
            elif live.request.state == "Active":
                self._guarded(live, self._draft_round)
                decoding.append(live)
        self._verify_rounds(decoding)
        self.model.synchronize()  # the step commits: its device work has completed
        for live in finishing:  # a turn's state is published once it is complete and fenced
            if self.live.get(live.request.id) is live:
                self._guarded(live, lambda x: self._leave(x, "finish"))
        self._reconcile()
        if not self.config.keep_finished:  # a long-running server forgets ended requests
            self.requests = {k: r for k, r in self.requests.items()
                             if r.state not in machine.TERMINAL}
        return self._commit()

    def _commit(self) -> list[ev.Event]:
        """Write the step's events as one transaction; rotate a journal past its size."""
        events = self.log.flush()
        if self.journal is not None and self.journal.full:
            self._rotate()
        return events

    def _rotate(self) -> None:
        """The next file opens with a snapshot of the store and of the open requests, at
        the next seq: replay and check start from it, and seqs stay gap-free."""
        self.journal = self.log.journal = self.journal.rotate()
        open_requests = {
            r.id: {"tenant": r.tenant, "session": r.session, "prompt_len": len(r.prompt),
                   "state": r.state, "outputs": len(r.outputs), "frontier": r.cursor,
                   "reuse_base": r.reuse_base}
            for r in self.requests.values() if r.state not in machine.TERMINAL}
        self.log.emit(ev.StoreSnapshotted, previous=self.journal.meta["previous"],
                      store=self.store.snapshot(), requests=open_requests,
                      max_concurrency=self.config.max_concurrency)
        self.log.flush()

    def idle(self) -> bool:
        return not self.live and not self.waiting and self.commands.empty()

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Submit):
                self._admit(command)
                continue
            request = self.requests.get(command.id)
            if isinstance(command, Stop):
                if request is not None and request.state == "Active":
                    request.stop_reason = command.reason
                    machine.fire(request, "stop")
            elif request is not None and request.state not in machine.TERMINAL:
                self._cancel(request)

    def _admit(self, c: Submit) -> None:
        request = Request(
            id=c.id, prompt=c.prompt, session=c.session, tenant=c.tenant, log=self.log,
            mode=self.mode, params=c.params, boundaries=tuple(sorted(set(c.boundaries))),
            shared_prefix=c.shared_prefix, journal_tokens=self.config.journal_tokens)
        self.requests[c.id] = request
        machine.admit(request)
        self.waiting.append(request)

    def _guarded(self, live: Live, work: Callable[[Live], None]) -> None:
        """Run a lane's work; a broken state part fails the request, never the engine."""
        try:
            work(live)
        except (MissingStatePart, KeyError, IndexError) as exc:
            log.error("request %s failed: %s", live.request.id, exc, exc_info=True)
            self._fail(live.request, "internal", str(exc))

    # --- scheduling --------------------------------------------------------------------

    def _schedule(self) -> None:
        while self.waiting and len(self.live) < self.config.max_concurrency:
            if not self._start(self.waiting[0]):
                return
            self.waiting.popleft()

    def _fits(self, request: Request) -> bool:
        """Room for the whole request beside the lanes already running. Alone, a request
        may always start (it evicts endpoints as it goes); beside others it waits, so that
        preempted requests do not come straight back and preempt in turn."""
        if not self.live:
            return True
        positions = len(request.sequence) + request.params.max_tokens + self.config.draft_tokens
        need = self.blocks.blocks_for(positions) * (2 if self.runner.mtp else 1)
        return self.blocks.free >= need

    def _start(self, request: Request) -> bool:
        """Plan and materialize; False (and nothing held) when memory is short now."""
        if not self._fits(request):
            return False
        if self.slots.free == 0 and not self._evict_one():
            return False
        live = Live(request, self.runner.new_lane(), AdaptiveDraft(self.config.draft_tokens),
                    self.choose(request))

        def usable(endpoint: EndpointFacts) -> str | None:
            held = self.held.get(endpoint.checkpoint.id)
            return None if held is not None else "checkpoint tensors are not held"

        request.plan = planner.plan(request.sequence, _hashes(request), request.tenant,
                                    request.session, self.store, self.mode, usable)
        try:
            if request.plan.endpoint is None:
                self.runner.init_root(live.lane)
            else:
                self.runner.restore(self.held[request.plan.endpoint.checkpoint.id], live.lane,
                                    self.config.check_reuse)
        except OutOfMemory:
            self.runner.release_lane(live.lane)
            return self._evict_one() and self._start(request)
        request.cursor = request.plan.reuse_base
        request.salvage_candidates = lambda: self._salvage_candidates(live)
        self.live[request.id] = live
        machine.fire(request, "start")
        return True

    def _free_memory(self, exclude: Live) -> bool:
        """Evict the least recently used endpoint, else preempt the newest other lane."""
        if self._evict_one():
            return True
        victims = [x for x in self.live.values()
                   if x is not exclude and x.request.state in ("Prefilling", "Active")]
        if victims:
            self._preempt(victims[-1])
            return True
        return False

    def _evict_over_capacity(self) -> None:
        for endpoint_id in self.store.over_capacity():
            self.log.emit(ev.EndpointEvicted, endpoint=endpoint_id, reason="capacity")

    def _reserve(self, live: Live, attn_upto: int, mtp_upto: int = 0) -> bool:
        """Blocks for the lane's next work, freeing memory as needed; False if the request
        was preempted or failed instead."""
        while True:
            try:
                self.runner.reserve(live.lane, attn_upto, mtp_upto)
                return True
            except OutOfMemory as exc:
                if not self._free_memory(live):
                    if len(self.live) > 1:  # others will finish and free memory: wait
                        self._preempt(live)
                    else:
                        self._fail(live.request, "capacity",
                                   f"the KV pool cannot hold this request: {exc}")
                    return False
                if live.request.id not in self.live:
                    return False

    # --- lane work ---------------------------------------------------------------------

    def _prefill_step(self, live: Live) -> None:
        request, lane = live.request, live.lane
        seq = request.sequence
        start = request.cursor
        end = min(start + self.config.prefill_chunk, request.target)
        for split in self._checkpoint_positions(request):
            if start < split < end:
                end = split
                break
        if not self._reserve(live, end, end if self.runner.mtp else 0):
            return
        if self.runner.mtp:  # the MTP layer catches up on the chunk the main model committed
            self.runner.mtp_catch_up(lane, seq, start)
            for held in live.captures:
                self.runner.extend(held, lane)
        if end > start:
            greedy, logits = self.runner.prefill(lane, seq, start, end)
            request.cursor = end
            request.emit(ev.PrefillAdvanced, cursor=end)
            self._capture_at(live, end)
        if request.cursor == request.target:
            first = None
            if not request.outputs:  # a fresh request: end > start always (reuse < target)
                first = live.choice.next(greedy, logits)
                request.outputs.append(first)
                request.emit(ev.TokensCommitted, tokens=(first,), frontier=request.cursor,
                             logprobs=_logprobs(request, None if logits is None
                                                else logits[None], (first,)))
            machine.fire(request, "prefilled", first_token=first)
            self._check_stop(request, None)

    def _checkpoint_positions(self, request: Request) -> list[int]:
        return sorted(set(self._anchor_positions(request)) | {request.shared_prefix} - {0})

    def _anchor_positions(self, request: Request) -> tuple[int, ...]:
        n = self.config.auto_anchors
        return request.boundaries[-n:] if n > 0 else ()

    def _capture_at(self, live: Live, position: int) -> None:
        request = live.request
        roles = []
        if position == request.shared_prefix:
            roles.append("shared")
        if position in self._anchor_positions(request):
            roles.append("anchor")
        if position < request.target:  # a cut prefill resumes here if its frontier lags
            roles.append("fallback")     # (MTP catching up) or is not fenced yet
        for role in roles:
            if self.slots.free == 0 and not self._evict_one():
                return
            tokens = request.sequence[:position]
            held = self.runner.capture(live.lane, self._next_cp(request), tokens, role)
            live.captures.append(held)
            request.emit(ev.CheckpointCaptured, checkpoint=self._facts(held))
        self._prune_fallbacks(live)

    def _prune_fallbacks(self, live: Live) -> None:
        """Keep the newest fallback capture and the newest complete one; release the rest."""
        fallbacks = [h for h in live.captures if h.role == "fallback"]
        keep = set(fallbacks[-1:])
        complete = [h for h in fallbacks if h.mtp_kv >= h.position - 1]
        keep.update(complete[-1:])
        for held in fallbacks:
            if held not in keep:
                live.captures.remove(held)
                self.runner.release_held(held)

    def evict(self, endpoint_id: str, reason: str = "operator") -> None:
        """Drop an endpoint from the store (as an event) and release its storage."""
        self.log.emit(ev.EndpointEvicted, endpoint=endpoint_id, reason=reason)
        self._reconcile()
        self._commit()

    def _evict_one(self) -> bool:
        if not self.store.endpoints:
            return False
        victim = min(self.store.endpoints, key=lambda e: self.store.endpoints[e].last_used_seq)
        self.log.emit(ev.EndpointEvicted, endpoint=victim, reason="memory")
        self._reconcile()
        return True

    def _draft_round(self, live: Live) -> None:
        """A round's first half: memory, drafts, the test hook. Leaves `live.round`."""
        request, lane = live.request, live.lane
        frontier = request.cursor
        room = min(request.params.max_tokens - len(request.outputs),
                   self.config.max_context - frontier - 1)
        k = min(live.drafting.next_k(), room - 1) if self.mode.spec != "none" else 0
        mtp_upto = frontier + max(k, 1) if self.runner.mtp else 0
        if not self._reserve(live, frontier + k + 1, mtp_upto):
            return
        if self._plain_next(live, k) and room > 1 and isinstance(live.choice, GreedyChoice) \
                and getattr(self.runner.model, "runs_ahead", False):
            try:  # the next position's block too, for the step the model runs ahead
                self.runner.reserve(lane, frontier + 2)
            except OutOfMemory:
                pass  # that step is then not run ahead: only time is lost
        drafts, probs = self.runner.draft(lane, request.sequence, frontier, k, live.choice)
        if self.runner.mtp:
            for held in live.captures:
                self.runner.extend(held, lane)
        if self.draft_hook is not None and self.draft_hook(request):
            self.runner.discard_round(lane, frontier)
            self._cancel(request)
            return
        live.round = (frontier, room, drafts, probs)

    def _plain_next(self, live: Live, drafts: int) -> bool:
        """Whether this round (with `drafts` drafts) and the lane's next feed one token
        each: no speculation, or drafting paused past the next round."""
        return self.mode.spec == "none" or (drafts == 0 and not live.drafting.drafts_next())

    def _verify_rounds(self, lives: list[Live]) -> None:
        """One batched verify forward for every lane with a drafted round, then each
        lane's acceptance and commit. A lane whose parts are broken fails alone."""
        lives = [x for x in lives if x.round is not None and x.request.id in self.live]
        items = [(x.lane, [x.request.sequence[-1], *x.round[2]], x.round[0]) for x in lives]
        # plain greedy decode: every lane that goes on feeds its greedy token next, so the
        # model may run that step ahead; not when a lane makes its last token (a step run
        # ahead then is wasted, and whatever is queued after it waits for it). With
        # drafting paused, a round without drafts whose next round drafts none is a plain step
        greedy = all(isinstance(x.choice, GreedyChoice) for x in lives)
        ahead = greedy and all(x.round[1] > 1 and self._plain_next(x, len(x.round[2]))
                               for x in lives)
        logits = not greedy or any(x.request.params.logprobs > 0 for x in lives)
        try:
            outs = self.runner.forward_many(items, ahead=ahead, logits=logits)
        except MissingStatePart:  # find the broken lane: one forward each
            outs = []
            for live, item in zip(lives, items, strict=True):
                try:
                    outs.append(self.runner.forward_many([item])[0])
                except MissingStatePart as exc:
                    self._fail(live.request, "internal", str(exc))
                    outs.append(None)
        for live, out in zip(lives, outs, strict=True):
            if out is not None:
                self._guarded(live, lambda x, o=out: self._commit_round(x, o))
            live.round = None

    def _commit_round(self, live: Live, out) -> None:
        request, lane = live.request, live.lane
        frontier, room, drafts, probs = live.round
        rnd = self.runner.judge(drafts, probs, out, live.choice)
        live.drafting.observe(rnd.drafted, rnd.accepted)
        count, reason = truncate(rnd.new_tokens, room, request.params.stop_tokens)
        committed = tuple(rnd.new_tokens[:count])
        request.outputs.extend(committed)
        # while drafting pauses, the MTP layer catches up in batches, not every token
        lag = frontier + count - 1 - lane.mtp_valid
        eager = not live.drafting.paused or lag >= MTP_BATCH
        self.runner.commit(lane, rnd, count, frontier, request.sequence, catch_up=eager)
        request.cursor = frontier + count
        request.emit(ev.TokensCommitted, tokens=committed, frontier=request.cursor,
                     drafted=rnd.drafted, accepted=min(rnd.accepted, count),
                     logprobs=_logprobs(request, out.logits, committed))
        self._check_stop(request, reason)

    def _check_stop(self, request: Request, reason: str | None) -> None:
        if reason is None:
            if request.outputs and request.outputs[-1] in request.params.stop_tokens:
                reason = "stop_token"
            elif len(request.outputs) >= request.params.max_tokens:
                reason = "max_tokens"
            elif request.cursor + 1 >= self.config.max_context:
                reason = "context_limit"
        if reason is not None:
            request.stop_reason = reason
            machine.fire(request, "stop")

    def _catch_up(self, live: Live) -> None:
        """The MTP layer catches up before a finished turn's state is published."""
        if self.runner.mtp:
            request = live.request
            self.runner.mtp_catch_up(live.lane, request.sequence, request.cursor - 1)
            for held in live.captures:
                self.runner.extend(held, live.lane)

    # --- leaving: finish, cancel, preempt, fail ------------------------------------------

    def _salvage_candidates(self, live: Live) -> list[Candidate]:
        """The frontier (the lane's own storage, handed over) first, then the captures."""
        request = live.request
        out = []
        if request.cursor > 0 and live.lane.slot >= 0:
            held = self.runner.hand_over(live.lane, self._next_cp(request),
                                         request.sequence[:request.cursor])
            live.captures.insert(0, held)
        for held in live.captures:
            if held.role == "fallback":
                continue
            out.append(Candidate(held.role, self._facts(held)))
        out.extend(Candidate("fallback", self._facts(h))
                   for h in reversed(live.captures) if h.role == "fallback")
        return out

    def _leave(self, live: Live, trigger: str, **kwargs) -> None:
        """Fire a salvaging trigger, then keep what was published and release the rest."""
        request = live.request
        self.live.pop(request.id, None)
        machine.fire(request, trigger, **kwargs)
        published = {e.checkpoint.id for e in (request.salvage.published if request.salvage
                                               else ())}
        for held in live.captures:
            if held.id in published:
                self.held[held.id] = held
                if self.files is not None:
                    self.files.save(self.model, held)
            else:
                self.runner.release_held(held)
        live.captures.clear()
        self.runner.release_lane(live.lane)
        request.salvage = None
        self._evict_within_session(request.tenant, request.session)

    def _evict_within_session(self, tenant: str, session: str | None) -> None:
        """Keep one session key's private endpoints distinct branches within its bound
        (lifecycle/conversation.py): evict, as events, those a later one extends
        (`superseded`), then the least recently used past the bound (`session_bound`)."""
        if session is None:
            return

        def extends(newer: EndpointFacts, older: EndpointFacts) -> bool:
            a, b = self.held[newer.checkpoint.id].tokens, self.held[older.checkpoint.id].tokens
            return a[:len(b)] == b

        for victim in conversation.evictions(self.store.private(tenant, session),
                                             self.store.endpoints_per_session, extends):
            self.log.emit(ev.EndpointEvicted, conversation=session, endpoint=victim.endpoint,
                          reason=victim.reason)

    def _cancel(self, request: Request) -> None:
        live = self.live.get(request.id)
        if live is None:
            if request in self.waiting:
                self.waiting.remove(request)
            machine.fire(request, "cancel")
            return
        self._leave(live, "cancel")

    def _preempt(self, live: Live) -> None:
        self._leave(live, "preempt")
        self.waiting.appendleft(live.request)

    def _fail(self, request: Request, failure: str, message: str) -> None:
        live = self.live.pop(request.id, None)
        if request in self.waiting:
            self.waiting.remove(request)
        machine.fire(request, "fail", failure=failure, message=message)
        if live is not None:
            for held in live.captures:
                self.runner.release_held(held)
            live.captures.clear()
            self.runner.release_lane(live.lane)

    # --- bookkeeping -------------------------------------------------------------------

    def _next_cp(self, request: Request) -> str:
        return f"{request.id}#{next(self._cp_ids)}"

    def _facts(self, held: Held):
        return held.facts(self.model, self.config.journal_tokens)

    def _reconcile(self) -> None:
        """Release checkpoints the store no longer holds (superseded, evicted, lost)."""
        wanted = self.store.checkpoint_ids()
        for cp_id in [c for c in self.held if c not in wanted]:
            self.runner.release_held(self.held.pop(cp_id))
            if self.files is not None:
                self.files.delete(cp_id)

    def check_integrity(self) -> None:
        """Invariant 6, conservation: pool use equals what lanes and endpoints hold."""
        refs = [0] * self.blocks.num_blocks
        slots: list[int] = []
        owners: list[Held] = list(self.held.values())
        for live in self.live.values():
            for block in live.lane.attn_blocks + live.lane.mtp_blocks:
                refs[block] += 1
            slots.append(live.lane.slot)
            owners.extend(live.captures)
        for held in owners:
            for block in held.attn_blocks + held.mtp_blocks:
                refs[block] += 1
            slots.append(held.slot)
        if refs != self.blocks.refs:
            bad = [b for b in range(len(refs)) if refs[b] != self.blocks.refs[b]]
            raise AssertionError(f"block refcounts differ from holders at blocks {bad[:8]}")
        if sorted(slots) != sorted(self.slots.in_use) or len(set(slots)) != len(slots):
            raise AssertionError(f"slots in use {sorted(self.slots.in_use)} != {sorted(slots)}")
        if set(self.held) != self.store.checkpoint_ids():
            raise AssertionError("held checkpoints differ from the store's endpoints")
        if not self.live and not self.store.endpoints:
            assert self.blocks.free == self.blocks.num_blocks, "blocks leaked"
            assert self.slots.free == self.slots.num_slots, "slots leaked"

    def close_for_restart(self) -> dict[str, Held]:
        """A crash: live lanes and captures vanish; published checkpoints' storage is
        returned for a restart that keeps tensors (unflushed events are lost)."""
        for live in self.live.values():
            for held in live.captures:
                self.runner.release_held(held)
            self.runner.release_lane(live.lane)
        self.live.clear()
        return self.held


def _logprobs(request: Request, rows, tokens) -> tuple[dict, ...] | None:
    """Log-probabilities of committed tokens, when asked for and the model has logits."""
    if request.params.logprobs <= 0 or rows is None:
        return None
    from .sampling import token_logprobs
    return token_logprobs(rows, tokens, request.params.logprobs)


def _hashes(request: Request) -> tuple[int, ...]:
    return block_hashes(request.sequence) if request.outputs else request.hashes


def run_until_idle(engine: Engine, max_steps: int = 100_000) -> int:
    steps = 0
    while not engine.idle() and steps < max_steps:
        engine.step()
        steps += 1
    return steps


def make_sim_engine(config: EngineConfig, *, num_blocks: int = 256, block_size: int = 4,
                    num_slots: int = 32, journal=None, seed: int = 0) -> Engine:
    from ..model.sim import SimModel
    model = SimModel(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots, seed=seed)
    engine = Engine(model, config, blocks=BlockPool(num_blocks, block_size),
                    slots=SlotPool(num_slots), journal=journal)
    engine.recover()
    return engine


__all__ = ["Engine", "EngineConfig", "Submit", "Cancel", "ReuseMismatch", "run_until_idle",
           "make_sim_engine"]
