"""Simulated clients: conversations that arrive over virtual time, think between turns and
disconnect at chosen moments, as the server's HTTP clients do.

A client sees its request's events as the server's streaming does (a listener on the event
log, called on the engine thread as each event is emitted), and disconnects as the server
does: `engine.cancel`, which lands at the next step boundary. Between draft and verify it
disconnects through `engine.draft_hook`. Every choice comes from the simulation's one rng.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field

from ..lifecycle import events as ev
from .clock import VirtualClock
from .harness import Harness
from .scenario import Scenario

VOCAB = 97          # SimModel's default vocabulary
MAX_PROMPT = 240    # a conversation ends before its prompt outgrows this
TENANTS = ("acme", "beta", "corp")


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(VOCAB) for _ in range(n))


@dataclass(eq=False)
class Client:
    """One conversation (or one-off request) and what it does next."""

    name: str
    tenant: str
    session: str | None
    system: tuple[int, ...]      # its system prompt, shared with other clients
    share: bool                  # the system prompt is sent as a shared prefix
    turns: int                   # turns it still means to send after this one
    stop_tokens: tuple[int, ...]
    prompt: tuple[int, ...]      # the messages of its next (or current) request
    boundaries: tuple[int, ...]  # message boundaries in `prompt`
    wake: float = 0.0            # when it sends `prompt`, if not waiting on a request
    request: str | None = None   # the request it waits on
    deadline: float = math.inf   # it gives up on the request then
    cut: tuple[str, int] | None = None  # ("event" | "retry" | "draft" | "stop", n): how it
    #                                      disconnects, or has the server stop its request
    seen: int = 0                # events (or, for "draft", rounds) of its request so far
    outputs: list[int] = field(default_factory=list)
    gone: bool = False

    @property
    def shared_prefix(self) -> int:
        n = len(self.system)
        return n if self.share and self.prompt[:n] == self.system else 0


class Clients:
    def __init__(self, rng: random.Random, clock: VirtualClock, harness: Harness,
                 scenario: Scenario, faults: Counter) -> None:
        self.rng, self.clock, self.h, self.s, self.faults = rng, clock, harness, scenario, faults
        self.tenants = TENANTS[:rng.randint(2, len(TENANTS))]
        # the same system prompts under several tenants: tenant isolation has work to do
        self.systems = [_tokens(rng, rng.randint(3, 20)) for _ in range(3)]
        self.clients: list[Client] = []          # arrival order: iteration is deterministic
        self.by_request: dict[str, Client] = {}
        self.next_arrival = 0.0
        self.arriving = True
        self.arrived = 0

    def attach(self, engine) -> None:
        """Follow `engine` (the first, or the one a restart booted)."""
        engine.log.listeners.append(self._on_event)
        engine.draft_hook = self._draft_hook

    # --- the passing of time -------------------------------------------------------------

    def act(self) -> None:
        """Everything due by now: arrivals, turns sent after thinking, deadlines passed."""
        now = self.clock()
        while self.arriving and self.next_arrival <= now:
            burst = self.rng.random() < self.s.burst  # long prompts at once: pools run short
            if len(self.clients) < self.s.max_clients:
                for _ in range(self.rng.randint(1, 3) if burst else 1):
                    self._arrive(long_prompt=burst)
            self.next_arrival += self.rng.expovariate(self.s.arrival_rate)
        for c in self.clients:
            if c.gone:
                continue
            if c.request is None and c.wake <= now:
                self._send(c)
            elif c.request is not None and c.deadline <= now:
                self.faults["deadline"] += 1
                self._disconnect(c)
        self.clients = [c for c in self.clients if not c.gone]

    def next_wake(self) -> float | None:
        """The next moment a client acts (for an idle server to wait until)."""
        times = [c.deadline if c.request is not None else c.wake for c in self.clients]
        if self.arriving:
            times.append(self.next_arrival)
        return min(times, default=None)

    def stop(self) -> None:
        """No more arrivals; each client leaves once its current request ends."""
        self.arriving = False
        for c in self.clients:
            c.gone = c.gone or c.request is None

    def settled(self) -> bool:
        return not any(c.request is not None for c in self.clients)

    def interrupted(self) -> None:
        """A restart: every request in flight is gone, as the connections that carried it."""
        for c in self.clients:
            if c.request is not None:
                self.by_request.pop(c.request, None)
                c.request = None
                self._again(c)

    # --- arriving, sending -----------------------------------------------------------------

    def _arrive(self, long_prompt: bool = False) -> None:
        rng, now = self.rng, self.clock()
        self.arrived += 1
        tenant = rng.choice(self.tenants)
        stop = rng.choice(((), (), (0,), (rng.randrange(VOCAB),)))
        if long_prompt:
            self.faults["long_prompt"] += 1
            system, share, turns = (), False, rng.randint(0, 1)
            limit = self.s.config.max_context
            near = limit <= 256 and rng.random() < 0.3  # decoding runs into the context limit
            user = _tokens(rng, rng.randint(limit - 24, limit - 1) if near else
                           rng.randint(48, 160))
        else:
            system, share = rng.choice(self.systems), rng.random() < 0.6
            turns = 0 if rng.random() < 0.1 else rng.randint(1, 6)
            user = _tokens(rng, rng.randint(1, 16))
        session = None if turns == 0 and rng.random() < 0.5 else f"s{self.arrived}"
        if session is not None and self.clients and rng.random() < 0.15:
            # a session key in use already (the same explicit key, or the same instructions
            # and first message): under this tenant or another, requests race on it
            session = rng.choice(self.clients).session or session
        self.clients.append(Client(
            f"c{self.arrived}", tenant, session, system, share, turns, stop,
            prompt=system + user, boundaries=(len(system),) if system else (), wake=now))

    def _send(self, c: Client) -> None:
        rng = self.rng
        try:
            rid = self.h.submit(c.prompt, c.session, c.tenant,
                                max_tokens=rng.choice((1, 2, 4, 6, 8, 12, 24)),
                                stop_tokens=c.stop_tokens, boundaries=c.boundaries,
                                shared_prefix=c.shared_prefix)
        except ValueError:  # refused at admission (past max_context): the client gives up
            self.faults["refused_at_admission"] += 1
            c.gone = True
            return
        c.request, c.seen, c.outputs = rid, 0, []
        c.deadline = self.clock() + rng.uniform(2.0, 12.0)
        c.cut = None
        if rng.random() < self.s.cut:
            kind = rng.choice(("event", "event", "retry", "draft", "stop"))
            c.cut = (kind, rng.randint(1, 16) if kind in ("event", "retry") else
                     rng.randint(1, 4))
        self.by_request[rid] = c

    # --- what a client sees -------------------------------------------------------------------

    def _on_event(self, e: ev.Event) -> None:
        c = self.by_request.get(e.request) if e.request is not None else None
        if c is None:
            return
        if isinstance(e, ev.TokensCommitted):
            c.outputs.extend(e.tokens)
        if e.kind in ev.CLIENT_END_KINDS:
            del self.by_request[e.request]
            c.request = None
            if isinstance(e, ev.RequestFinished):
                self._next_turn(c)
            else:  # failed (capacity, interrupted): the same messages again
                self._again(c)
            return
        if c.cut is None or c.cut[0] == "draft":
            return
        kind, n = c.cut
        if kind == "stop":  # the server finds a stop string in the text of the n-th commit
            c.seen += isinstance(e, ev.TokensCommitted)
            if c.seen == n and isinstance(e, ev.TokensCommitted):
                self.faults["stop_string"] += 1
                self.h.engine.stop_request(c.request)
            return
        c.seen += 1
        if c.seen != n:
            return
        self.faults[f"disconnect_{kind}"] += 1
        if kind == "retry":  # the seed's client: cut, and the same messages at once
            self._disconnect(c, wake=self.clock())
        else:
            self._disconnect(c)

    def _draft_hook(self, request) -> bool:
        """Called between a round's draft and its verify: True cuts the request there."""
        c = self.by_request.get(request.id)
        if c is None or c.cut is None or c.cut[0] != "draft":
            return False
        c.seen += 1
        if c.seen < c.cut[1]:
            return False
        self.faults["disconnect_draft"] += 1
        self._detach(c)  # the engine cancels it itself, discarding the round
        self._after_cut(c)
        return True

    # --- what a client does next ----------------------------------------------------------------

    def _detach(self, c: Client) -> None:
        del self.by_request[c.request]
        c.request = None

    def _disconnect(self, c: Client, wake: float | None = None) -> None:
        """Drop the connection: the server cancels at its next step boundary."""
        self.h.engine.cancel(c.request)
        self._detach(c)
        if wake is not None and self.arriving:
            c.wake = wake
        else:
            self._after_cut(c)

    def _think(self) -> float:
        return self.clock() + self.rng.expovariate(1 / 0.3)

    def _after_cut(self, c: Client) -> None:
        """Back after a disconnect: the same messages, or on with what it had received."""
        if self.rng.random() < 0.5 or not c.outputs:
            self._again(c)
        else:
            self._continue(c)

    def _again(self, c: Client) -> None:
        c.gone = c.gone or not self.arriving
        c.wake = self._think()

    def _next_turn(self, c: Client) -> None:
        if c.turns <= 0 or not self.arriving:
            c.gone = True
            return
        c.turns -= 1
        choice = self.rng.random()
        if choice < 0.1:
            self._again(c)                   # a retry: the same messages
        elif choice < 0.25 and len(c.prompt) > 1:
            self._rewrite(c)                 # an earlier turn edited
        else:
            self._continue(c)

    def _continue(self, c: Client) -> None:
        """The next turn: the prompt, the outputs it saw, a new message."""
        history = c.prompt + tuple(c.outputs)
        prompt = history + _tokens(self.rng, self.rng.randint(1, 16))
        if len(prompt) > MAX_PROMPT:
            c.gone = True
            return
        c.boundaries = tuple(sorted(set(c.boundaries) | {len(c.prompt), len(history)}))
        c.prompt = prompt
        c.wake = self._think()

    def _rewrite(self, c: Client) -> None:
        cut = self.rng.randint(1, len(c.prompt) - 1)
        c.prompt = c.prompt[:cut] + _tokens(self.rng, self.rng.randint(1, 16))
        c.boundaries = tuple(b for b in c.boundaries if b < cut) + (cut,)
        c.wake = self._think()
