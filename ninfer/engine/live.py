"""A request holding a lane, and the stop rules both prefill and decode apply."""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..lifecycle.request import Request
from ..model.protocol import Lane
from .choice import Choice
from .runner import Held
from .speculative import AdaptiveDraft, NgramIndex

if TYPE_CHECKING:
    from .rounds import DraftedRound


@dataclass(eq=False)
class Pending:
    """A prefill chunk's forward run in parts (`Model.forward_steps`), a part a step beside
    decoding lanes: the generator, and the chunk [start, end) with its stops."""

    steps: Generator[None, None, tuple]
    start: int
    end: int
    stops: list[int]


@dataclass(eq=False)
class Live:
    """A request holding a lane: its storage, its captured checkpoints, how it drafts and
    chooses tokens, the round it drafted this step (until the step's verify), and a prefill
    forward it has begun and not finished (`pending`)."""

    request: Request
    lane: Lane
    drafting: AdaptiveDraft
    choice: Choice
    captures: list[Held] = field(default_factory=list)
    round: DraftedRound | None = None
    ngrams: NgramIndex = field(default_factory=NgramIndex)   # n-gram drafting's lookup
    pending: Pending | None = None

    def drop_pending(self) -> None:
        """Leave an unfinished forward: the lane's slot was never written by it, so the
        lane stays at its cursor (the KV it wrote lies past it)."""
        if self.pending is not None:
            self.pending.steps.close()
            self.pending = None


# Reserve blocks for a lane's next work (attention KV up to, MTP KV up to); False when the
# lane gave way instead (preempted or failed)
Reserve = Callable[[Live, int, int], bool]


def stop_reason(request: Request, max_context: int, reason: str | None = None) -> str | None:
    """Why an active request stops after its last commit (`reason` if the commit already
    knows), or None while it goes on."""
    if reason is not None:
        return reason
    if request.outputs and request.outputs[-1] in request.params.stop_tokens:
        return "stop_token"
    if len(request.outputs) >= request.params.max_tokens:
        return "max_tokens"
    if request.cursor + 1 >= max_context:
        return "context_limit"
    return None
