"""Speculative rounds: draft, one batched verify for every decoding lane, accept, commit.

A round has two halves around the step's one batched forward. `draft` reserves memory,
drafts up to k tokens and leaves a `DraftedRound` on the lane; `verify` feeds every
drafted lane's pending token and drafts in one forward, then `commit` accepts the longest
agreeing prefix (or by rejection sampling), rolls every state part back to it and
commits the tokens. A round with no drafts is a plain decode step. A cancel between the
halves discards the round as a whole (`discard`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..lifecycle import events as ev
from ..lifecycle.facts import Mode
from ..lifecycle.request import Request
from ..model.pools import OutOfMemory
from ..model.protocol import MissingStatePart
from .choice import Choice, GreedyChoice
from .live import Live, Reserve, stop_reason
from .runner import Runner
from .speculative import truncate

# most committed positions the MTP layer may lag while drafting pauses: more than a pause
# lasts (AdaptiveDraft's 32 rounds), so it catches up once, for the probe that ends it (each
# catch-up is an eager MTP forward; on an H100 catching up every 64 rather than 16 tokens
# decoded 1.07x faster with drafting paused: bench/results/mtp-paused-h100.json)
MTP_BATCH = 64


class DraftedRound(NamedTuple):
    """A round's first half, waiting for the step's verify."""

    frontier: int               # committed positions when the round began
    room: int                   # tokens the request may still commit
    drafts: list[int]           # proposed tokens, possibly none
    probs: Any                  # the drafts' distributions when sampled, else None


class Verified(NamedTuple):
    """A lane whose round the step's forward verified (`out` None: its parts were broken,
    and the request has failed)."""

    live: Live
    out: Any


class Rounds:
    def __init__(self, runner: Runner, mode: Mode, *, max_context: int,
                 reserve: Reserve) -> None:
        self.runner, self.mode, self.max_context = runner, mode, max_context
        self.reserve = reserve

    def plain_next(self, live: Live, drafts: int) -> bool:
        """Whether this round (with `drafts` drafts) and the lane's next feed one token
        each: no speculation, or drafting paused past the next round."""
        return self.mode.spec == "none" or (drafts == 0 and not live.drafting.drafts_next())

    def draft(self, live: Live) -> bool:
        """A round's first half: memory, drafts. False when the lane gave way for memory."""
        request, lane, runner = live.request, live.lane, self.runner
        frontier = request.cursor
        room = min(request.params.max_tokens - len(request.outputs),
                   self.max_context - frontier - 1)
        k = min(live.drafting.next_k(), room - 1) if self.mode.spec != "none" else 0
        mtp_upto = frontier + max(k, 1) if runner.mtp else 0
        if not self.reserve(live, frontier + k + 1, mtp_upto):
            return False
        if self.plain_next(live, k) and room > 1 and isinstance(live.choice, GreedyChoice) \
                and runner.model.runs_ahead:
            try:  # the next position's block too, for the step the model runs ahead
                runner.reserve(lane, frontier + 2)
            except OutOfMemory:
                pass  # that step is then not run ahead: only time is lost
        drafts, probs = runner.draft(lane, request.so_far, frontier, k, live.choice,
                                     live.ngrams)
        admitted = live.choice.admit(drafts)  # a grammar cuts them before the verify
        drafts, probs = drafts[:admitted], probs[:admitted] if probs is not None else None
        if runner.mtp:
            for held in live.captures:
                runner.extend(held, lane)
        live.round = DraftedRound(frontier, room, drafts, probs)
        return True

    def discard(self, live: Live) -> None:
        """Drop a drafted round as a whole (a cut between draft and verify)."""
        self.runner.discard_round(live.lane, live.round.frontier)
        live.round = None

    def verify(self, lives: list[Live], fail: Callable[[Request, str], None]
               ) -> list[Verified]:
        """One batched verify forward for every lane with a drafted round. A lane whose
        parts are broken fails alone (`fail(request, message)`); the others go on."""
        lives = [x for x in lives if x.round is not None]
        items = [(x.lane, [x.request.last_token, *x.round.drafts], x.round.frontier)
                 for x in lives]
        # plain greedy decode: every lane that goes on feeds its greedy token next, so the
        # model may run that step ahead; not when a lane makes its last token (a step run
        # ahead then is wasted, and whatever is queued after it waits for it). With
        # drafting paused, a round without drafts whose next round drafts none is a plain step
        greedy = all(isinstance(x.choice, GreedyChoice) for x in lives)
        ahead = greedy and all(x.round.room > 1 and self.plain_next(x, len(x.round.drafts))
                               for x in lives)
        logits = not greedy or any(x.request.params.logprobs > 0 for x in lives)
        for live in lives:  # a grammar's masks, computed while the forward runs
            live.choice.prepare(live.round.drafts)
        try:
            outs = self.runner.forward_many(items, ahead=ahead, logits=logits)
        except MissingStatePart:  # find the broken lane: one forward each
            outs = []
            for live, item in zip(lives, items, strict=True):
                try:
                    outs.append(self.runner.forward_many([item])[0])
                except MissingStatePart as exc:
                    fail(live.request, str(exc))
                    outs.append(None)
        return [Verified(live, out) for live, out in zip(lives, outs, strict=True)]

    def commit(self, live: Live, out) -> str | None:
        """Accept, roll back to the accepted prefix and commit; the stop reason, if the
        request stops here."""
        request, lane, drafted = live.request, live.lane, live.round
        live.round = None
        rnd = self.runner.judge(drafted.drafts, drafted.probs, out, live.choice)
        live.drafting.observe(rnd.drafted, rnd.accepted)
        count, reason = truncate(rnd.new_tokens, drafted.room, request.params.stop_tokens)
        committed = tuple(rnd.new_tokens[:count])
        reported = logprobs(request, live.choice, out.logits, committed)  # before they commit
        request.outputs.extend(committed)
        # while drafting pauses, the MTP layer catches up in batches, not every token
        lag = drafted.frontier + count - 1 - lane.mtp_valid
        eager = not live.drafting.paused or lag >= MTP_BATCH
        self.runner.commit(lane, rnd, count, drafted.frontier, request.so_far,
                           catch_up=eager)
        request.cursor = drafted.frontier + count
        request.emit(ev.TokensCommitted, tokens=committed, frontier=request.cursor,
                     drafted=rnd.drafted, accepted=min(rnd.accepted, count),
                     logprobs=reported)
        return stop_reason(request, self.max_context, reason)


def logprobs(request: Request, choice: Choice, rows, tokens) -> tuple[dict, ...] | None:
    """Log-probabilities of tokens about to be committed (row i of `rows` chose tokens[i]),
    when asked for and the model has logits: of the logits as the choice sees them (a logit
    bias added, a grammar's mask applied)."""
    if request.params.logprobs <= 0 or rows is None:
        return None
    from .sampling import token_logprobs
    return token_logprobs(choice.shaped(rows[:len(tokens)], tokens), tokens,
                          request.params.logprobs)
