"""A request holding a lane, and the stop rules both prefill and decode apply."""

from __future__ import annotations

from collections.abc import Callable
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
class Live:
    """A request holding a lane: its storage, its captured checkpoints, how it drafts and
    chooses tokens, and the round it drafted this step (until the step's verify)."""

    request: Request
    lane: Lane
    drafting: AdaptiveDraft
    choice: Choice
    captures: list[Held] = field(default_factory=list)
    round: DraftedRound | None = None
    ngrams: NgramIndex = field(default_factory=NgramIndex)   # n-gram drafting's lookup


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
