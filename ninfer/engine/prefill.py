"""Prefill: a lane's prompt fed in chunks, checkpoints captured where they may be reused.

A chunk ends at the next checkpoint position (the end of the shared prefix, an anchor at
a message boundary) so the state there can be captured, unless it is at most
`Model.keeps_states_up_to` tokens (a next turn's short message): then it runs in one forward
that keeps every position's state, and its checkpoints inside are picked from those. Every
checkpoint position short of the target is captured as a fallback too, so a cut prefill can
publish the newest point whose parts are complete. Under MTP the MTP layer catches up on
what the main model committed before the next chunk, and before a finished turn is
published.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

from ..lifecycle import events as ev
from ..lifecycle.facts import CheckpointFacts
from ..lifecycle.request import Request
from ..model.protocol import run_through
from .live import Live, Pending, Reserve, stop_reason
from .rounds import logprobs
from .runner import Held, Runner


class Prefilled(NamedTuple):
    """The prefill reached its target: the request becomes Active, and stops at once if
    its first token ends it."""

    first_token: int | None     # sampled here for a fresh request; None on a resume
    stop: str | None


class Prefill:
    def __init__(self, runner: Runner, *, chunk: int, auto_anchors: int, max_context: int,
                 reserve: Reserve, free_slot: Callable[[], bool],
                 checkpoint_id: Callable[[Request], str],
                 facts: Callable[[Held], CheckpointFacts]) -> None:
        """`free_slot`: make a recurrent-state slot free (False: none can be);
        `checkpoint_id` names a new checkpoint; `facts` describes a held one."""
        self.runner, self.chunk = runner, chunk
        self.auto_anchors, self.max_context = auto_anchors, max_context
        self.reserve, self.free_slot = reserve, free_slot
        self.checkpoint_id, self.facts = checkpoint_id, facts

    def step(self, live: Live, limit: int | None = None,
             parts: bool = False) -> Prefilled | None:
        """One chunk (of at most `limit` tokens, when given); `Prefilled` when the target is
        reached, else None (a detached prefill stops at its goal, samples nothing and is
        never `Prefilled`). `parts`: launch one part of the chunk's forward (beside decoding
        lanes, whose steps then come between the parts), keeping the rest in
        `live.pending` for the next calls; a call with a forward pending goes on with it
        (without `parts`, to its end)."""
        request, lane, runner = live.request, live.lane, self.runner
        seq = request.so_far
        greedy: Any = None
        logits: Any = None
        if live.pending is not None:
            pending = live.pending
            start, end, stops = pending.start, pending.end, pending.stops
            done = _one_part(pending.steps) if parts else run_through(pending.steps)
            if done is None:
                return None
            live.pending = None
            greedy, logits, kept = done
        else:
            start = request.cursor
            end = min(start + min(self.chunk, limit or self.chunk), request.prefill_goal)
            stops = [p for p in self.checkpoint_positions(request) if start < p < end]
            if stops and end - start > runner.model.keeps_states_up_to:
                end, stops = stops[0], []  # a forward per piece, captured at its end
            if not self.reserve(live, end, end if runner.mtp else 0):
                return None
            if runner.mtp:  # the MTP layer catches up on the chunk the main model committed
                runner.mtp_catch_up(lane, seq, start)
                for held in live.captures:
                    runner.extend(held, lane)
            if end > start and not parts:
                greedy, logits, kept = runner.prefill(lane, seq, start, end, stops)
            elif end > start:
                steps = runner.prefill_steps(lane, seq, start, end, stops)
                done = _one_part(steps)
                if done is None:
                    live.pending = Pending(steps, start, end, stops)
                    return None
                greedy, logits, kept = done
        if end > start:
            for stop in stops:  # captured from the states the one forward kept there
                request.cursor = stop
                request.emit(ev.PrefillAdvanced, cursor=stop)
                self._capture_at(live, stop, kept[stop])
            request.cursor = end
            request.emit(ev.PrefillAdvanced, cursor=end)
            self._capture_at(live, end)
        if request.cursor != request.target or request.state == "Detached":
            return None
        first = None
        if not request.outputs:  # a fresh request: end > start always (reuse < target)
            first = live.choice.next(greedy, logits)
            reported = logprobs(request, live.choice, None if logits is None else logits[None],
                                (first,))
            request.outputs.append(first)
            request.emit(ev.TokensCommitted, tokens=(first,), frontier=request.cursor,
                         logprobs=reported)
        return Prefilled(first, stop_reason(request, self.max_context))

    def catch_up(self, live: Live) -> None:
        """The MTP layer catches up before a finished turn's state is published."""
        if self.runner.mtp:
            request = live.request
            self.runner.mtp_catch_up(live.lane, request.so_far, request.cursor - 1)
            for held in live.captures:
                self.runner.extend(held, live.lane)

    def checkpoint_positions(self, request: Request) -> list[int]:
        return sorted(set(self._anchor_positions(request)) | {request.shared_prefix} - {0})

    def _anchor_positions(self, request: Request) -> tuple[int, ...]:
        n = self.auto_anchors
        return request.boundaries[-n:] if n > 0 else ()

    def _capture_at(self, live: Live, position: int, state: tuple | None = None) -> None:
        """Checkpoints at `position` in the roles it has: of the lane's frontier, or of
        `state` (`Runner.prefill`'s, kept at a stop inside its forward)."""
        request = live.request
        roles = []
        if position == request.shared_prefix:
            roles.append("shared")
        if position in self._anchor_positions(request):
            roles.append("anchor")
        if position < request.target:  # a cut prefill resumes here if its frontier lags
            roles.append("fallback")     # (MTP catching up) or is not fenced yet
        for role in roles:
            if not self.free_slot():
                return
            tokens = request.so_far[:position]
            held = self.runner.capture(live.lane, self.checkpoint_id(request), tokens, role,
                                       request.sequence_hashes, state)
            live.captures.append(held)
            # timelines are its one reader: the ids (its request's prompt's prefix, already
            # journaled) would make the row O(context) on the way to the first token
            request.emit(ev.CheckpointCaptured,
                         checkpoint=dataclasses.replace(self.facts(held), tokens=None))
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


def _one_part(steps) -> tuple | None:
    """Run a part of a forward in parts: what it returned if that part ended it, else None."""
    try:
        next(steps)
    except StopIteration as done:
        return done.value
    return None
