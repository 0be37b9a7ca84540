"""`ninfer journal redrive`: the recorded request stream, run again through today's code.

What is replayed is what came from outside the engine: each request (prompt ids, tenant,
session, parameters, message boundaries), when it arrived, where its client cut it, stop
strings the server found, operator evictions, and restarts with their options. What is
compared is what the engine decided: each request's plan and reuse base, what it published
and refused, and its outcome.

- Arrival: a request is submitted once every request that had started before it in the
  recording has come as far in the new run (the same state, as many tokens): the order the
  recording saw, whatever the speed.
- Cuts: a request cancelled in the recording is cancelled once it reaches the same state
  and frontier (queued; prefilled up to the cursor; that many tokens committed).
- Tokens: each request commits the recorded output ids (drafts are judged against them), so
  every later prompt and every checkpoint covers the same tokens as in the recording, with
  SimModel as with the recorded model; with that model (`--model`), how often its own
  greedy choice agreed with the recorded token is reported too.
- Restarts: at each recorded `ServerStarted` the engine restarts with its options, keeping
  tensors unless the recording lost endpoints for want of them.

Needs token ids: a journal written with `--journal-content hashes` cannot be redriven.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from ..engine.engine import Engine, EngineConfig, Submit
from ..engine.speculative import accept_greedy
from ..lifecycle import events as ev
from ..lifecycle.checks import JournalChecker
from ..lifecycle.conversation import SESSION_BOUND, SUPERSEDED
from ..lifecycle.journal import Journal
from ..lifecycle.request import SamplingParams
from ..lifecycle.store import InvariantViolation
from ..model.pools import BlockPool, SlotPool

ENDED = (4, 0)
# a detached prefill goes on prefilling (its cursor is its progress), with no client
STATE_RANK = {"Queued": 0, "Prefilling": 1, "Detached": 1, "Active": 2, "Finishable": 3}
# evictions the engine makes itself (a redriven engine makes them again), not an operator's
ENGINE_EVICTIONS = ("capacity", "memory", SUPERSEDED, SESSION_BOUND)
COMPARED = ("plan", "published", "refused", "outcome", "outputs")
SIM_VOCAB = 1 << 20      # SimModel's vocabulary in a redrive: any recorded id fits
SIM_BLOCKS, SIM_SLOTS = 8192, 512
STALL_STEPS = 20_000     # steps without the awaited progress before giving up on it


class RedriveError(Exception):
    """A journal that cannot be redriven (no token ids, no server start)."""


# --- what a journal says happened ------------------------------------------------------------


@dataclass
class Decisions:
    """What the engine decided for one request."""

    plan: tuple | None = None                 # (plan kind, reuse_base) of the last start
    published: list = field(default_factory=list)   # (kind, position)
    refused: list = field(default_factory=list)     # (position, reason)
    outcome: tuple | None = None              # (terminal kind, at_state / failure)
    outputs: int = 0

    def row(self) -> dict[str, Any]:
        return {"plan": self.plan, "published": sorted(self.published),
                "refused": sorted(self.refused), "outcome": self.outcome,
                "outputs": self.outputs}


@dataclass
class Recorded:
    """One request of the recording: its inputs, its cut, its decisions."""

    id: str
    submit: Submit
    outputs: list[int] = field(default_factory=list)
    cut: tuple | None = None                  # progress at which the client cut it
    stop_string_at: int | None = None         # outputs when the server found a stop string
    decisions: Decisions = field(default_factory=Decisions)


@dataclass
class Action:
    """Something from outside the engine, once the others have come as far as `after`."""

    kind: str                                 # submit | evict | restart
    after: dict[str, tuple]                   # request -> progress reached in the recording
    request: str | None = None
    endpoint: tuple | None = None             # evict: (request, kind, position) it came from
    started: ev.ServerStarted | None = None   # restart
    lose_tensors: bool = False


@dataclass
class Recording:
    requests: dict[str, Recorded]
    actions: list[Action]
    first: ev.ServerStarted
    meta: dict


def _progress(state: str, cursor: int, outputs: int) -> tuple:
    rank = STATE_RANK.get(state)
    if rank is None:
        return ENDED
    return (rank, cursor if rank == 1 else outputs if rank >= 2 else 0)


class _Follower:
    """Folds events into per-request decisions and progress; one for the recording, one
    for the new run, so both are read the same way."""

    def __init__(self) -> None:
        self.decisions: dict[str, Decisions] = {}
        self.state: dict[str, str] = {}
        self.cursor: dict[str, int] = {}
        self.progress: dict[str, tuple] = {}
        self.published_by: dict[str, tuple] = {}   # endpoint id -> (request, kind, position)

    def feed(self, e: ev.Event) -> None:
        rid, k = e.request, e.kind
        if k == "EndpointPublished":
            f = e.endpoint
            self.published_by[f.id] = (rid, f.kind, f.position)
        if rid is None:
            return
        d = self.decisions.setdefault(rid, Decisions())
        if k == "RequestQueued":
            self.state[rid], self.cursor[rid] = "Queued", 0
        elif k == "RequestStarted":
            d.plan = (e.plan, e.reuse_base)
            self.state[rid], self.cursor[rid] = "Prefilling", e.reuse_base
        elif k == "PrefillAdvanced":
            self.cursor[rid] = e.cursor
        elif k == "PrefillCompleted":
            self.state[rid] = "Active"
        elif k == "PrefillDetached":
            self.state[rid] = "Detached"
        elif k == "TokensCommitted":
            d.outputs += e.committed
        elif k == "StopReached":
            self.state[rid] = "Finishable"
        elif k == "RequestPreempted":
            self.state[rid] = "Queued"
        elif k == "EndpointPublished":
            d.published.append((e.endpoint.kind, e.endpoint.position))
        elif k == "PublicationRefused":
            d.refused.append((e.position, e.reason))
        elif k in ev.TERMINAL_KINDS:
            detail = getattr(e, "at_state", None) or getattr(e, "failure", None)
            d.outcome = (k, detail)
            self.state[rid] = k
        now = _progress(self.state[rid], self.cursor.get(rid, 0), d.outputs)
        self.progress[rid] = max(now, self.progress.get(rid, (0, 0)))


def read_recording(events: Iterable[ev.Event], meta: dict | None = None) -> Recording:
    follow = _Follower()
    requests: dict[str, Recorded] = {}
    actions: list[Action] = []
    first: ev.ServerStarted | None = None
    crash: dict | None = None   # progress when a restart's recovery began
    lost_tensors = False
    for e in events:
        recovering = isinstance(e, ev.EndpointLost) or (
            isinstance(e, ev.RequestFailed) and e.failure == "interrupted")
        if recovering and crash is None:
            crash = dict(follow.progress)  # before recovery closes what the crash left open
        if isinstance(e, ev.EndpointLost) and "survive" in e.reason:
            lost_tensors = True
        if isinstance(e, ev.ServerStarted):
            if first is None:
                first = e
            else:
                actions.append(Action("restart", crash if crash is not None
                                      else dict(follow.progress), started=e,
                                      lose_tensors=lost_tensors))
            crash, lost_tensors = None, False
        elif isinstance(e, ev.StoreSnapshotted) and not requests:
            raise RedriveError("this file is a rotated journal's continuation; redrive the "
                               "chain from its first file")
        elif isinstance(e, ev.RequestQueued):
            if e.tokens is None:
                raise RedriveError("the journal holds no token ids (written with "
                                   "--journal-content hashes): there is nothing to redrive")
            params = dict(e.params)
            params["stop_tokens"] = tuple(params.get("stop_tokens", ()))
            params["reasoning_close"] = tuple(params.get("reasoning_close", ()))
            submit = Submit(e.request, tuple(e.tokens), e.conversation, e.tenant,
                            SamplingParams(**params), tuple(e.boundaries), e.shared_prefix)
            requests[e.request] = Recorded(e.request, submit)
            actions.append(Action("submit", dict(follow.progress), request=e.request))
        elif isinstance(e, ev.EndpointEvicted) and e.reason not in ENGINE_EVICTIONS:
            actions.append(Action("evict", dict(follow.progress),
                                  endpoint=follow.published_by.get(e.endpoint)))
        if e.request in requests:
            r = requests[e.request]
            if isinstance(e, ev.TokensCommitted):
                r.outputs.extend(e.tokens or ())
            elif isinstance(e, ev.StopReached) and e.reason == "stop_string":
                r.stop_string_at = len(r.outputs)
            elif isinstance(e, ev.PrefillDetached):  # the client's cut; its end comes later
                r.cut = max(_progress("Prefilling", e.cursor, len(r.outputs)),
                            follow.progress.get(e.request, (0, 0)))
            elif isinstance(e, ev.RequestCancelled) and e.at_state != "Detached":
                # where it had come to: a request preempted back to the queue and cut
                # there was cut after it had run that far
                r.cut = max(_progress(e.at_state, follow.cursor.get(e.request, 0),
                                      len(r.outputs)), follow.progress.get(e.request, (0, 0)))
        follow.feed(e)
    if first is None:
        raise RedriveError("the journal has no ServerStarted: nothing was served")
    for rid, r in requests.items():
        r.decisions = follow.decisions[rid]
    return Recording(requests, actions, first, meta or {})


# --- running it again ------------------------------------------------------------------------


class ForcedChoice:
    """Commits the recorded tokens: a draft is accepted while it equals them. Counts how
    often the model's own greedy choice agreed (meaningful with the recorded model)."""

    def __init__(self, recorded: list[int], outputs: list[int], tally: list[int]) -> None:
        self.recorded, self.outputs, self.tally = recorded, outputs, tally

    def _forced(self, i: int, greedy: int) -> int:
        if i >= len(self.recorded):
            return greedy  # past the recording (today's code runs longer): the model decides
        self.tally[0] += greedy == self.recorded[i]
        self.tally[1] += 1
        return self.recorded[i]

    def draft(self, greedy: int, logits: Any, before=()) -> tuple[int, Any]:
        return greedy, None

    def next(self, greedy: int, logits: Any) -> int:
        return self._forced(len(self.outputs), greedy)

    def accept(self, drafts, greedy, logits, draft_probs) -> tuple[int, int]:
        base = len(self.outputs)
        want = self.recorded[base:base + len(drafts)]
        accepted = accept_greedy(drafts[:len(want)], want) if want else 0
        return accepted, self._forced(base + accepted, greedy[accepted])


@dataclass
class Outcome:
    compared: int
    differences: list[dict]
    violations: list[str]
    stalls: list[str]
    model: str
    agreement: tuple[int, int]       # (greedy agreed with the recorded token, tokens forced)
    events: int

    @property
    def same(self) -> bool:
        return not self.differences and not self.violations and not self.stalls


def _config(started: ev.ServerStarted) -> EngineConfig:
    o = started.options
    return EngineConfig(
        max_concurrency=started.max_concurrency, spec=started.mode.spec,
        max_endpoints=started.max_endpoints, prefill_chunk=o.get("prefill_chunk", 512),
        # a journal from before a key held several endpoints kept one, replaced: bound 1
        endpoints_per_session=started.endpoints_per_session or 1,
        draft_tokens=o.get("draft_tokens", 3), auto_anchors=o.get("auto_anchors", 2),
        max_context=o.get("max_context", 8192), keep_finished=True,
        detach_prefills=o.get("detach_prefills", False))


class Redrive:
    def __init__(self, recording: Recording,
                 model_factory: Callable[[int, int, int], Any] | None = None,
                 progress: Callable[[int], None] | None = None, *,
                 kv_positions: int = SIM_BLOCKS * 16, slots: int = SIM_SLOTS) -> None:
        """`model_factory(num_blocks, block_size, num_slots)`: SimModel by default.
        `kv_positions` and `slots` size the pools (generous: the recording's memory
        pressure is not replayed, its outcomes are compared)."""
        self.rec = recording
        self.sizes = (-(-kv_positions // recording.first.options.get("block_size", 16)), slots)
        self.block_size = recording.first.options.get("block_size", 16)
        self.model_factory = model_factory or _sim_factory
        self.progress = progress or (lambda n: None)
        self.journal = Journal.memory()
        self.follow = _Follower()
        self.checker = JournalChecker()
        self.violations: list[str] = []
        self.stalls: list[str] = []
        self.tally = [0, 0]
        self.engine = self._boot(None, _config(recording.first))

    def _boot(self, kept: tuple | None, config: EngineConfig) -> Engine:
        if kept is None:
            num_blocks, num_slots = self.sizes
            model = self.model_factory(num_blocks, self.block_size, num_slots)
            blocks, slots = BlockPool(num_blocks, self.block_size), SlotPool(num_slots)
            held = None
        else:
            model, blocks, slots, held = kept
        engine = Engine(model, config, blocks=blocks, slots=slots, journal=self.journal,
                        held=held)
        engine.log.listeners.append(self._watch)
        engine.choose = self._choice
        engine.recover()
        return engine

    def _watch(self, e: ev.Event) -> None:
        self.follow.feed(e)
        if self.checker is None:
            return
        try:
            self.checker.feed(e)
        except InvariantViolation as v:
            self.violations.append(str(v))
            self.checker = None  # its bookkeeping is off from here: report the first only

    def _choice(self, request) -> ForcedChoice:
        return ForcedChoice(self.rec.requests[request.id].outputs, request.outputs, self.tally)

    # --- driving -----------------------------------------------------------------------

    def _reached(self, rid: str, target: tuple) -> bool:
        return self.follow.progress.get(rid, (0, 0)) >= target or \
            self.follow.progress.get(rid) == ENDED

    def _step(self) -> None:
        self.engine.step()
        for rid, r in self.rec.requests.items():
            if self.follow.progress.get(rid) in (None, ENDED):
                continue
            request = self.engine.requests.get(rid)
            if r.cut is not None and self._reached(rid, r.cut):
                self.engine.cancel(rid)
            elif (r.stop_string_at is not None and request is not None
                  and len(request.outputs) >= r.stop_string_at):
                self.engine.stop_request(rid)

    def _wait(self, after: dict[str, tuple], what: str) -> None:
        steps = 0
        while not all(self._reached(rid, p) for rid, p in after.items()
                      if rid in self.rec.requests):
            if self.engine.idle() or steps >= STALL_STEPS:
                late = [rid for rid, p in after.items()
                        if rid in self.rec.requests and not self._reached(rid, p)]
                self.stalls.append(f"before {what}: {', '.join(late)} did not come as far as "
                                   "in the recording")
                return
            self._step()
            steps += 1

    def run(self) -> Outcome:
        for n, action in enumerate(self.rec.actions, 1):
            self._wait(action.after, f"{action.kind} {action.request or ''}".strip())
            if action.kind == "submit":
                self._submit(self.rec.requests[action.request])
            elif action.kind == "evict":
                self._evict(action.endpoint)
            else:
                self._restart(action)
            self.progress(n)
        steps = 0
        while not self.engine.idle() and steps < STALL_STEPS:
            self._step()
            steps += 1
        if not self.engine.idle():
            self.stalls.append("the engine did not become idle at the end")
        return self._compare()

    def _submit(self, r: Recorded) -> None:
        try:
            self.engine.submit(r.submit)
        except ValueError as exc:  # today's validation refuses it (another max_context, say)
            self.follow.decisions[r.id] = Decisions(outcome=("Refused", str(exc)))
            self.follow.progress[r.id] = ENDED
            return
        self.follow.progress.setdefault(r.id, (0, 0))
        if r.cut == (0, 0):  # cut while it waited in the queue
            self.engine.cancel(r.id)

    def _evict(self, origin: tuple | None) -> None:
        ids = {v: k for k, v in self.follow.published_by.items()}
        endpoint = ids.get(origin) if origin else None
        if endpoint is not None and endpoint in self.engine.store.endpoints:
            self.engine.evict(endpoint)

    def _restart(self, action: Action) -> None:
        engine = self.engine
        held = engine.close_for_restart()
        kept = None if action.lose_tensors else (engine.model, engine.blocks, engine.slots, held)
        self.engine = self._boot(kept, replace(_config(action.started)))

    def _compare(self) -> Outcome:
        differences = []
        for rid, r in self.rec.requests.items():
            then = r.decisions.row()
            now = self.follow.decisions.get(rid, Decisions()).row()
            changed = [k for k in COMPARED if then[k] != now[k]]
            if changed:
                differences.append({"request": rid, "conversation": r.submit.session,
                                    "fields": changed,
                                    "recorded": {k: then[k] for k in changed},
                                    "redriven": {k: now[k] for k in changed}})
        model = self.engine.model.identity
        return Outcome(len(self.rec.requests), differences, self.violations, self.stalls,
                       model, (self.tally[0], self.tally[1]), self.journal.last_seq)


def _sim_factory(num_blocks: int, block_size: int, num_slots: int):
    from ..model.sim_model import SimModel
    return SimModel(num_blocks=num_blocks, block_size=block_size, num_slots=num_slots,
                    vocab_size=SIM_VOCAB)


def redrive(events: Iterable[ev.Event], meta: dict | None = None, model_factory=None,
            progress=None, **sizes) -> Outcome:
    """Redrive a journal's events (in seq order) and compare the decisions."""
    return Redrive(read_recording(events, meta), model_factory, progress, **sizes).run()
